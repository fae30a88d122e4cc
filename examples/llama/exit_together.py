"""Every rank leaves on a user error at the same moment, with the same status.

A configuration error (or an error mesh3d raised on every rank alike) ends every rank of the job.
Under torchrun the first rank to exit decides how the others end: its agent polls the workers
every 0.1 s and sends SIGTERM to all that still run once one has failed, so a rank that reaches
the error a little later (it imported torch more slowly, it was still printing) is reported as
`exitcode: -15 (SIGTERM)` in torchrun's summary, and one that had not printed its message yet
never does. So here each rank first says it has arrived, in the job's key-value store (the
process group's, or torchrun's agent store before a group exists), rank 0 having printed the
message before it arrives; no rank leaves before every rank has arrived (or ARRIVAL_TIMEOUT_S has
passed: a rank that did not hit the error is not waited for forever). Then all leave together,
under torchrun at once (os._exit, no interpreter finalization to outlast the agent's poll), and a
SIGTERM that still comes between two ranks' exits ends the rank with the same status.
Without a store to meet in (argparse's errors in tests/train_launch.py's forked ranks) the ranks
other than 0 wait GRACE_S, so that rank 0 has printed first.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from mesh3d.distributed.rendezvous import restart_count, uses_agent_store

# How long a rank waits for the others to reach the same error before it leaves without them.
ARRIVAL_TIMEOUT_S = 60.0
# Without a store: how long the ranks other than 0 wait, so that rank 0 prints before torchrun
# stops the job.
GRACE_S = 2.0
_KEY = "mesh3d/exit_together"


def exit_together(message: str | None, status: int = 2) -> None:
    """Print `message` on rank 0 (stderr), meet the other ranks, and raise SystemExit(status) on
    every rank. A rank that waited ARRIVAL_TIMEOUT_S in vain prints the message itself, with its
    rank, since rank 0 may not have seen the error."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if under_torchrun:  # torchrun's SIGTERM while the peers exit: the same status
        signal.signal(signal.SIGTERM, lambda signum, frame: _leave_now(status))
    if message and rank == 0:
        print(message, file=sys.stderr, flush=True)
    if world > 1:
        store = _store(world)
        if store is None:
            if rank != 0:
                time.sleep(GRACE_S)
        elif not _all_arrived(store, world) and message and rank != 0:
            print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)
    if under_torchrun:
        _leave_now(status)
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(status)


def _leave_now(status: int) -> None:
    """Exit at once: a torch interpreter's finalization takes long enough (and restores SIGTERM's
    default on the way) for torchrun to see a peer gone and stop this rank with SIGTERM; a worker
    process of torchrun's has nothing left to finalize on a user error."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _store(world: int) -> dist.Store | None:
    """The store every rank of this job can reach now, or None."""
    if dist.is_initialized():
        try:
            return dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError):
            return None
    if not uses_agent_store() or "MASTER_ADDR" not in os.environ:
        return None  # rank 0 would host the store: none exists before the process group
    try:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=False,
            timeout=timedelta(seconds=ARRIVAL_TIMEOUT_S),
        )
    except (RuntimeError, ValueError, OSError):
        return None


def _all_arrived(store: dist.Store, world: int) -> bool:
    """Count this rank in; wait until every rank has counted itself (True) or the timeout (False)."""
    key, began = f"{_KEY}/{restart_count()}", time.monotonic()
    try:
        if store.add(key, 1) >= world:
            store.set(f"{key}/all", "1")
            return True
        store.set_timeout(timedelta(seconds=ARRIVAL_TIMEOUT_S))
        store.wait([f"{key}/all"])
        return True
    except (RuntimeError, OSError):
        # The timeout: a rank never came. Sooner: the store's host (rank 0, outside torchrun) left,
        # which it does only once every rank has come.
        return time.monotonic() - began < ARRIVAL_TIMEOUT_S / 2
