"""Where a rank's shard sits in the global tensor (distributed/shards.py), against torch's own split.

A packed expert weight split by "packed_colwise" is a `_StridedShard`: a rank holds a slice of the
gate half and the matching slice of the up half, two windows. torch's `distribute_tensor` (which
splits a whole tensor locally when src_data_rank is None) is the reference: the windows
`shard_blocks` gives for each rank, copied out of the whole tensor in order, are exactly that
rank's local tensor, and together the ranks' windows cover the tensor once. Runs over torch's fake
process group (this process is every rank in turn: no message moves).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from mesh3d.distributed.shards import local_window, shard_blocks


@pytest.fixture
def tp_mesh():
    def make(rank: int, size: int = 2):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
        return init_device_mesh("cpu", (size,))

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def _assembled(whole: torch.Tensor, blocks, local_shape) -> torch.Tensor:
    out = torch.full(local_shape, float("nan"))
    for global_window, window in blocks:
        out[window] = whole[global_window]
    return out


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("placement", [_StridedShard(1, split_factor=2), _StridedShard(2, split_factor=2), Shard(2)])
def test_each_ranks_windows_are_its_shard_and_cover_the_tensor_once(tp_mesh, tp, placement):
    whole = torch.arange(3 * 8 * 16, dtype=torch.float32).reshape(3, 8, 16)
    covered = torch.zeros_like(whole)
    for rank in range(tp):
        mesh = tp_mesh(rank, tp)
        shard = distribute_tensor(whole.clone(), mesh, [placement], src_data_rank=None)
        blocks = shard_blocks(shard)
        assert torch.equal(_assembled(whole, blocks, shard.to_local().shape), shard.to_local())
        expected_windows = 2 if isinstance(placement, _StridedShard) else 1
        assert len(blocks) == expected_windows
        for global_window, _ in blocks:
            covered[global_window] += 1
        # Another rank's windows from this one (as checkpoints describe every rank's chunks).
        other = (rank + 1) % tp
        assert shard_blocks(shard, [other]) != blocks
    assert torch.equal(covered, torch.ones_like(whole))


def test_one_window_is_refused_for_a_strided_shard(tp_mesh):
    shard = distribute_tensor(torch.zeros(2, 8, 4), tp_mesh(0), [_StridedShard(1, split_factor=2)], src_data_rank=None)
    with pytest.raises(ValueError, match="several windows per rank"):
        local_window(shard)
