"""Counting the process groups a rank creates, by who must take part: the world, or the members.

`dist.new_group` is a call every rank of the world makes, members or not (it numbers the groups),
and `dist.split_group` a collective over the group it splits; a group made with
`use_local_synchronization` involves its members alone. The first kind is what grows a job's
start-up with its size (issue 66: one creation per group of the mesh is 33,920 at 16,384 ranks),
so a dry run counts both, wherever they are made: mesh3d's own groups (group_kinds.py) and those
torch makes for a DeviceMesh (its flattened and unflattened dims).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh
import torch.distributed.distributed_c10d as c10d

# The modules that hold their own name for torch's group-creating functions (each looks it up there).
_HOLDERS = (dist, c10d, device_mesh)


@contextlib.contextmanager
def counting_group_creations() -> Iterator[Counter]:
    """Count, while inside, this process's group creations: "world" (calls every rank of the world
    makes: new_group, split_group) and "local" (new_group among its members alone)."""
    counts: Counter = Counter()
    new_group, split_group = c10d.new_group, c10d.split_group

    def counted_new_group(*args, **kwargs):
        counts["local" if kwargs.get("use_local_synchronization") else "world"] += 1
        return new_group(*args, **kwargs)

    def counted_split_group(*args, **kwargs):
        counts["world"] += 1
        return split_group(*args, **kwargs)

    saved = [(holder, name, getattr(holder, name)) for holder in _HOLDERS for name in ("new_group", "split_group")]
    for holder, name, _ in saved:
        setattr(holder, name, counted_new_group if name == "new_group" else counted_split_group)
    try:
        yield counts
    finally:
        for holder, name, original in saved:
            setattr(holder, name, original)
