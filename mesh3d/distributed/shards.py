"""A DTensor seen from one rank: its local shard as a plain tensor, and where that shard sits in
the global tensor. Plain tensors pass through (they are whole on every rank that holds them).

Most shards are one window of the global tensor. A packed weight split by transformers'
"packed_colwise" (an expert's gate and up projections stored as one tensor, each half split over
tp) is a `_StridedShard`: a rank holds a slice of each half, so its shard is several windows
(`local_blocks`), and torch's own window function does not describe it.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import DTensor, Replicate

# Private on purpose: torch.distributed.tensor has no public function that says where a shard sits
# in the global tensor. DTensor.__create_chunk_list__ (distributed checkpoint's hook) calls this
# same function (the underscored one: at any mesh coordinate), and refuses Partial placements;
# torch's own checkpointing imports it as we do.
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)
from torch.distributed.tensor.placement_types import _StridedShard

Window = tuple[slice, ...]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def split_mesh_dims(tensor: DTensor) -> list[int]:
    """The mesh dims along which the tensor is split (plain or strided)."""
    return [mesh_dim for mesh_dim, placement in enumerate(tensor.placements) if splits_a_dim(placement)]


def strided_dims(tensor: torch.Tensor) -> dict[int, tuple[int, int]]:
    """{tensor dim: (mesh dim, split factor)} for each dim a lone `_StridedShard` splits (several windows)."""
    if not isinstance(tensor, DTensor):
        return {}
    out: dict[int, tuple[int, int]] = {}
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, _StridedShard):
            others = [p for p in tensor.placements if splits_a_dim(p) and p is not placement and p.dim == placement.dim]
            if not others:  # nested with another split of the same dim (FSDP over TP): one window, torch's rule
                out[placement.dim] = (mesh_dim, placement.split_factor)
    return out


def splits_a_dim(placement) -> bool:
    """Whether the placement splits a tensor dim (a `_StridedShard` is not `is_shard()` in torch)."""
    return placement.is_shard() or isinstance(placement, _StridedShard)


def shard_blocks(tensor: torch.Tensor, coordinate: list[int] | None = None) -> list[tuple[Window, Window]]:
    """(global window, window of the local shard) pairs that make up the shard at mesh `coordinate`
    (this rank's by default); one pair for all but strided shards, none for an empty shard."""
    if not isinstance(tensor, DTensor):
        whole = tuple(slice(0, n) for n in tensor.shape)
        return [(whole, whole)] if 0 not in tensor.shape else []
    mesh = tensor.device_mesh
    coordinate = list(mesh.get_coordinate() if coordinate is None else coordinate)
    strided = strided_dims(tensor)
    lone = {mesh_dim for mesh_dim, _ in strided.values()}
    plain = [Replicate() if mesh_dim in lone else p for mesh_dim, p in enumerate(tensor.placements)]
    shape, offset = _compute_local_shape_and_global_offset(tensor.shape, mesh.shape, coordinate, plain)
    runs_per_dim: list[list[tuple[int, int, int]]] = []  # per dim: (global start, local start, length)
    for dim, (size, start) in enumerate(zip(shape, offset)):
        if dim not in strided:
            runs_per_dim.append([(start, 0, size)])
            continue
        mesh_dim, factor = strided[dim]
        ranks, piece = mesh.size(mesh_dim), tensor.shape[dim] // factor
        if piece * factor != tensor.shape[dim] or piece % ranks:
            raise ValueError(
                f"dim {dim} of size {tensor.shape[dim]} is split into {factor} parts over {ranks} ranks unevenly; a "
                "strided shard here needs each part to divide evenly (tensor-parallel plans check it)"
            )
        per_rank = piece // ranks
        c = coordinate[mesh_dim]
        runs_per_dim.append([(j * piece + c * per_rank, j * per_rank, per_rank) for j in range(factor)])
    if any(length == 0 for runs in runs_per_dim for _, _, length in runs):
        return []
    blocks = []
    for runs in itertools.product(*runs_per_dim):
        blocks.append((tuple(slice(g, g + n) for g, _, n in runs), tuple(slice(lo, lo + n) for _, lo, n in runs)))
    return blocks


def local_blocks(tensor: torch.Tensor) -> list[tuple[Window, Window]]:
    """This rank's (global window, local window) pairs: see shard_blocks."""
    return shard_blocks(tensor)


def local_window(tensor: torch.Tensor) -> Window | None:
    """The slices of the global tensor that this rank's shard holds; None for an empty shard
    (more ranks than rows). For a plain tensor, the whole of it. A strided shard has no one window."""
    if isinstance(tensor, DTensor):
        if strided_dims(tensor):
            raise ValueError(
                f"a {tuple(tensor.shape)} tensor split as {tensor.placements} is several windows per rank: "
                "use local_blocks"
            )
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    else:
        shape, offset = tuple(tensor.shape), (0,) * tensor.dim()
    if 0 in shape:
        return None
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))
