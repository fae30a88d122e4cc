"""Strided shards in torch.distributed.checkpoint: several windows per rank, as windows.

A packed expert weight split by tensor parallelism (transformers' "packed_colwise": gate and up
halves each split, distributed/shards.py) is a DTensor with a `_StridedShard` placement: a rank
holds a slice of each half. DCP asks a DTensor for one window per rank and would get the wrong one
(torch computes a contiguous window), so such an entry and its optimizer state are handed to DCP as
a ShardedTensor instead, DCP's form for a rank holding several chunks: the chunks are views of the
local shard, so saving copies nothing and loading writes straight into the parameter. The
checkpoint holds the global tensor under its own name, windows and all, exactly as a
contiguously sharded or whole tensor would be stored: it loads under any layout.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.tensor import DTensor

from mesh3d.distributed.shards import shard_blocks, split_mesh_dims, strided_dims


def as_checkpointable(entries: dict[str, object]) -> dict[str, object]:
    """`entries` with every strided DTensor as a ShardedTensor of views of its local shard (the others as they are)."""
    return {key: _sharded(value) if _is_strided(value) else value for key, value in entries.items()}


@contextlib.contextmanager
def deliberate_sharded_tensors():
    """DCP warns, per ShardedTensor it meets, that ShardedTensor is deprecated for DTensor; a DTensor
    cannot describe a strided shard's windows to DCP (the module docstring), so here it is deliberate."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        yield


def take_replaced_values(entries: dict[str, object], checkpointable: dict[str, object]) -> None:
    """After DCP loaded `checkpointable`: put into `entries` the values it replaced rather than filled in
    place (hyperparameters, a step count held as a number); tensors were filled in place, views included."""
    for key, value in checkpointable.items():
        if not isinstance(value, (torch.Tensor, ShardedTensor)):
            entries[key] = value


def _is_strided(value) -> bool:
    return isinstance(value, DTensor) and bool(strided_dims(value))


def _sharded(tensor: DTensor) -> ShardedTensor:
    mesh, local = tensor.device_mesh, tensor.to_local()
    mine = list(mesh.get_coordinate())
    split = split_mesh_dims(tensor)
    device = "cpu" if local.device.type == "cpu" else f"{local.device.type}:{local.device.index}"

    def metadata(coordinate, global_window) -> ShardMetadata:
        rank = int(mesh.mesh[tuple(coordinate)].item())
        return ShardMetadata(
            [w.start for w in global_window], [w.stop - w.start for w in global_window], f"rank:{rank}/{device}"
        )

    # The shards of this rank's replica: every coordinate along the splitting mesh dims, this rank's along the others.
    everyone = []
    for coordinates in itertools.product(*(range(mesh.size(d)) for d in split)):
        coordinate = list(mine)
        for d, c in zip(split, coordinates):
            coordinate[d] = c
        everyone += [metadata(coordinate, window) for window, _ in shard_blocks(tensor, coordinate)]
    views = [(local[local_window], metadata(mine, window)) for window, local_window in shard_blocks(tensor)]
    # ShardedTensor takes contiguous shards only; DCP reads and writes any view. So it is built on
    # stand-ins (one local shard's size, freed at once) and handed the views after. Other ranks'
    # placements name this rank's device kind: DCP reads only their offsets and sizes.
    own = [Shard(torch.empty(view.shape, dtype=view.dtype, device=view.device), meta) for view, meta in views]
    properties = TensorProperties(dtype=local.dtype, requires_grad=False)
    sharded = ShardedTensor._init_from_local_shards_and_global_metadata(
        own, ShardedTensorMetadata(everyone, tensor.shape, properties)
    )
    for shard, (view, _) in zip(sharded.local_shards(), views):
        shard.tensor = view
    return sharded
