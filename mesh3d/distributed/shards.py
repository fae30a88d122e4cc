"""A DTensor seen from one rank: its local shard as a plain tensor, and where that shard sits in
the global tensor. Plain tensors pass through (they are whole on every rank that holds them)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

# Private on purpose: torch.distributed.tensor has no public function that says where a shard sits
# in the global tensor. DTensor.__create_chunk_list__ (distributed checkpoint's hook) calls this
# same function, and refuses Partial placements; torch's own checkpointing imports it as we do.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_window(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The slices of the global tensor that this rank's shard holds; None for an empty shard
    (more ranks than rows). For a plain tensor, the whole of it."""
    if isinstance(tensor, DTensor):
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    else:
        shape, offset = tuple(tensor.shape), (0,) * tensor.dim()
    if 0 in shape:
        return None
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))
