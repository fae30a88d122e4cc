"""The gloo group over the world that CPU-side exchanges run on when the main backend is NCCL.

On NCCL, `all_gather_object` travels as a CUDA tensor and its wait is a stream wait: a stopped
peer blocks this CPU in a device copy, where only NCCL's watchdog ends it, by ending the process
(nccl_watchdog.py). On a gloo group the CPU waits, bounded by the group's timeout, and a peer
that stops becomes a Python error on this rank. So `agree`'s exchanges (every rank agrees, or
every rank raises) keep gloo's behaviour on GPUs. `build_mesh` creates the group when the backend
is NCCL (every rank, in the same order: `new_group` is collective over the world).
"""

from __future__ import annotations

import torch.distributed as dist

_side: tuple[dist.ProcessGroup, object] | None = None  # the group, and the default group it was made in


def _default_group() -> dist.ProcessGroup | None:
    return dist.group.WORLD


def use_host_group(group: dist.ProcessGroup | None) -> None:
    """From now on, CPU-side exchanges run on `group` (None: on the default process group)."""
    global _side
    _side = None if group is None else (group, _default_group())


def host_group() -> dist.ProcessGroup | None:
    """The group CPU-side exchanges run on: the gloo side group while the default process group it
    was created in still stands; None (the default group) otherwise."""
    if _side is None or _side[1] is not _default_group():
        return None
    return _side[0]
