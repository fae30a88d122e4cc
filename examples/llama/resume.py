"""--resume: load the newest checkpoint that loads, saying which damaged ones were passed over."""

from __future__ import annotations

import torch

import mesh3d
from mesh3d.checkpoint import DamagedCheckpoint


def checkpoints_newest_first(root: str) -> list[str]:
    """Rank 0's list, on every rank: ranks listing the directory themselves could disagree while
    another job writes there, and load different checkpoints."""
    found = [[str(p) for p in reversed(mesh3d.checkpoint.complete_checkpoints(root))]]
    torch.distributed.broadcast_object_list(found, src=0)
    return found[0]


def resume_newest(root: str, pm, optimizer, say) -> tuple[str | None, dict | None]:
    """(path, state) of the newest checkpoint under `root` that loads into pm and optimizer, or
    (None, None) when there is none. A damaged one (a missing or truncated file, unreadable
    metadata) is reported through `say` and the next older one tried; any other error (a
    checkpoint of another model) is raised."""
    for path in checkpoints_newest_first(root):
        try:
            return path, mesh3d.checkpoint.load(path, pm, optimizer)
        except DamagedCheckpoint as damage:
            say(f"cannot resume from {path}: {damage}; trying the next older checkpoint")
    return None, None
