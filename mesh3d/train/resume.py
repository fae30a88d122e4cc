"""Resuming: the newest checkpoint under a root that loads, or exactly the one asked for.

`mesh3d.checkpoint.latest(root)` lists the root on the calling process only. A training job
resumes through `resume_latest` instead, which is sturdier in two ways:

- every rank loads the same checkpoint: rank 0's listing is broadcast, because ranks listing a
  shared directory themselves could disagree while another job (or a slow filesystem) writes
  there;
- a damaged checkpoint (a missing or truncated file, unreadable metadata, a file whose checksum
  changed since the save: `DamagedCheckpoint`, raised on every rank alike) is passed over with a
  message naming the file, and the next older one is tried.

`resume_from(path)` loads the checkpoint named, and nothing else: a missing, incomplete or
damaged one is an error on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from mesh3d.checkpoint.directories import complete_checkpoints, is_complete
from mesh3d.checkpoint.integrity import DamagedCheckpoint
from mesh3d.checkpoint.save_load import load
from mesh3d.distributed.agree import raise_if_any
from mesh3d.distributed.host_group import host_group
from mesh3d.parallel_model import ParallelModel


def checkpoints_newest_first(root: str | os.PathLike) -> list[str]:
    """The complete checkpoints under `root`, newest first, as rank 0 lists them, on every rank.

    Call on every rank (one broadcast when a process group of more than one rank is running)."""
    found = [[str(p) for p in reversed(complete_checkpoints(root))]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0, group=host_group())  # a host-side list: gloo under NCCL too
    return found[0]


def resume_latest(
    root: str | os.PathLike,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer | None = None,
    say: Callable[[str], object] = print,
) -> tuple[str | None, dict | None]:
    """Load the newest checkpoint under `root` that loads into pm (and optimizer). Call on every rank.

    Returns (path, state) with `state` as `mesh3d.checkpoint.load` returns it, or (None, None)
    when `root` holds no checkpoint that loads (a fresh start). A damaged checkpoint is reported
    through `say(message)` (on every rank: pass a callable that prints on one) and the next older
    one tried. Any other error, such as a checkpoint of another model, is raised.
    """
    for path in checkpoints_newest_first(root):
        try:
            return path, load(path, pm, optimizer)
        except DamagedCheckpoint as damage:
            say(f"cannot resume from {path}: {damage}; trying the next older checkpoint")
    return None, None


def resume_from(path: str | os.PathLike, pm: ParallelModel, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load exactly the checkpoint at `path` into pm (and optimizer). Call on every rank.

    Returns the state `mesh3d.checkpoint.load` returns. Raises ValueError on every rank when
    `path` is not a complete checkpoint (missing, or a save that never finished), and
    DamagedCheckpoint (a ValueError) when one of its files is missing, cut short or changed.
    """
    path = Path(path)
    problem = None
    if not path.is_dir():
        problem = f"resume_from: no checkpoint at {path} (no such directory)"
    elif not is_complete(path):
        problem = (
            f"resume_from: {path} is not a complete checkpoint (it needs .metadata and train_state.json, "
            "and a name not starting with a dot); an interrupted save is never published. "
            "Name a checkpoint directory such as ckpt/step100"
        )
    raise_if_any(problem)
    return load(path, pm, optimizer)
