"""NCCL's watchdog, set up before the process group starts: what ends a hung rank on GPUs.

On NCCL a `work.wait()` only makes the current CUDA stream wait for the communication stream; the
CPU blocks later, in a device-to-host copy (`.item()`), where no Python timeout reaches. What ends
an operation that never completes is ProcessGroupNCCL's watchdog thread: it holds every queued
operation against its group's timeout, counted from when the operation was queued, and then acts
as TORCH_NCCL_ASYNC_ERROR_HANDLING says. `build_mesh` sets the defaults below in the environment
before it creates an NCCL process group (torch reads them then), each one only where the user set
neither it nor an alias torch also reads:

- TORCH_NCCL_ASYNC_ERROR_HANDLING=1: abort the communicators, then end the process (torchrun's
  default for its workers; torch's own, 3, ends it without the abort). The process dies with the
  watchdog's "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..., OpType=RECV, ...)"
  and torchrun ends or restarts the job. Aborting frees the peers still inside the same
  communicators, which then fail ("ncclRemoteError", "NCCL communicator was aborted") instead of
  each waiting out its own timeout.
- TORCH_NCCL_DUMP_ON_TIMEOUT=1 with TORCH_FR_BUFFER_SIZE=2000: before that, each rank
  writes its flight recorder (the last 2000 operations, each with its state and the Python stack
  that queued it) to TORCH_NCCL_DEBUG_INFO_TEMP_FILE (torch's default: /tmp/nccl_trace_rank_<rank>),
  which says which operation each rank was stuck in. TORCH_FR_BUFFER_SIZE is the flight
  recorder's name since torch 2.11 (which warns that TORCH_NCCL_TRACE_BUFFER_SIZE, the older one,
  is deprecated, as seen on an H100); a user's value under either name stands.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# Each default, with the names torch also reads for the same setting (an older or a newer one).
WATCHDOG_DEFAULTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("1", ("NCCL_ASYNC_ERROR_HANDLING",)),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ("1", ()),
    "TORCH_FR_BUFFER_SIZE": ("2000", ("TORCH_NCCL_TRACE_BUFFER_SIZE",)),
}


def set_watchdog_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Put each of WATCHDOG_DEFAULTS into `environ` unless the user set it (or an alias of it).
    Call before the NCCL process group is created. Returns the variables it set."""
    chosen = {}
    for name, (value, aliases) in WATCHDOG_DEFAULTS.items():
        if not any(environ.get(n) for n in (name, *aliases)):
            environ[name] = chosen[name] = value
    return chosen
