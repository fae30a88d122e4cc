"""The loader on real ranks at (pp, dp, tp) = (2, 2, 2): ranks that share a dp coordinate draw the same
batches, and the dp shares make up the global batch (the loader alone: tests/unit/test_token_loader.py)."""

import numpy as np
import torch
from multiprocess import run_on_ranks

import mesh3d
from mesh3d.data import DistributedLoader, TokenDataset


def _stream() -> np.ndarray:
    """A synthetic token stream whose values are their own positions (mod 251)."""
    return (np.arange(10_000) % 251).astype(np.uint8)


def _batches_by_coordinate():
    layout = mesh3d.build_mesh(pp=2, dp=2, tp=2)
    loader = DistributedLoader.for_layout(TokenDataset(_stream(), seq_len=16), 8, layout, seed=11)
    return layout.coordinate, [next(loader)[0] for _ in range(3)]


def test_same_dp_coordinate_same_batches_across_ranks():
    per_rank = run_on_ranks(_batches_by_coordinate, 8, timeout=60)
    dataset = TokenDataset(_stream(), seq_len=16)
    # The first global batch, from the two dp shares drawn in this process.
    reference = torch.cat([next(DistributedLoader(dataset, 8, dp_rank=r, dp_size=2, seed=11))[0] for r in range(2)])
    by_dp = {}
    for (pp_rank, dp_rank, tp_rank), batches in per_rank:
        by_dp.setdefault(dp_rank, []).append(batches)
    assert sorted(by_dp) == [0, 1]
    for dp_rank, replicas in by_dp.items():
        assert len(replicas) == 4
        for other in replicas[1:]:
            assert all(torch.equal(a, b) for a, b in zip(replicas[0], other))
    first_step = torch.cat([by_dp[0][0][0], by_dp[1][0][0]])
    assert torch.equal(first_step, reference)
