"""build_mesh over every factorization of 1, 2, 4 and 8 ranks, and its errors on every rank.

In one launch per world size: sizes, coordinates, group members (checked with a real all-reduce
on each group), device and backend; dp=-1; a plain process without torchrun; bad sizes raise the
same ValueError on every rank before the process group exists, and again after it does;
mismatched layouts across ranks name both. The size arithmetic alone: tests/unit/test_mesh_sizes.py.
"""

import itertools
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from multiprocess import run_on_ranks

import mesh3d


def factorizations(world_size):
    return [
        (pp, dp, tp)
        for pp, dp, tp in itertools.product(range(1, world_size + 1), repeat=3)
        if pp * dp * tp == world_size
    ]


def expected_groups(pp, dp, tp):
    """Group membership from the definition rank = (pp_rank*dp + dp_rank)*tp + tp_rank."""
    rank_of = lambda p, d, t: (p * dp + d) * tp + t  # noqa: E731
    return {
        "tp": [[rank_of(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank_of(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank_of(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }


def _every_layout(world_size):
    """On each rank: build every factorization in one process group and describe what it got."""
    seen = {}
    for sizes in factorizations(world_size):
        layout = mesh3d.build_mesh(*sizes)
        # A real collective on each group proves the group exists and has the members it says.
        sums = {}
        for dim in ("pp", "dp", "tp"):
            t = torch.tensor([layout.rank])
            dist.all_reduce(t, group=layout.group(dim))
            sums[dim] = int(t)
        seen[sizes] = {
            "sizes": (layout.pp, layout.dp, layout.tp),
            "coordinate": layout.coordinate,
            "rank": layout.rank,
            "world_size": layout.world_size,
            "groups": {dim: layout.group_ranks(dim) for dim in ("pp", "dp", "tp")},
            "sums": sums,
            "device": str(layout.device),
            "backend": layout.backend,
            "repr": repr(layout),
        }
    # dp=-1 takes the rest of the world; numpy ints are ints.
    pp = 2 if world_size >= 4 else 1
    rest = mesh3d.build_mesh(pp=pp, tp=np.int64(world_size // pp // 2 or 1))
    seen["dp=-1"] = (rest.pp, rest.dp, rest.tp)
    return seen


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_every_factorization(world_size):
    per_rank = run_on_ranks(_every_layout, world_size, world_size, timeout=120)
    for sizes in factorizations(world_size):
        pp, dp, tp = sizes
        groups = expected_groups(pp, dp, tp)
        for rank, seen in enumerate(per_rank):
            got = seen[sizes]
            coordinate = (rank // (dp * tp), (rank // tp) % dp, rank % tp)
            assert got["sizes"] == sizes
            assert got["rank"] == rank and got["world_size"] == world_size
            assert got["coordinate"] == coordinate, (sizes, rank)
            for dim in ("pp", "dp", "tp"):
                mine = next(g for g in groups[dim] if rank in g)
                assert got["groups"][dim] == mine, (sizes, rank, dim)
                assert got["sums"][dim] == sum(mine), (sizes, rank, dim)
            # tp groups are runs of consecutive global ranks.
            tp_group = got["groups"]["tp"]
            assert tp_group == list(range(tp_group[0], tp_group[0] + tp))
            assert got["device"] == "cpu" and got["backend"] == "gloo"
            assert f"pp={pp}, dp={dp}, tp={tp}" in got["repr"]
            assert f"coordinate=(pp {coordinate[0]}, dp {coordinate[1]}, tp {coordinate[2]})" in got["repr"]
    pp = 2 if world_size >= 4 else 1
    tp = world_size // pp // 2 or 1
    assert all(seen["dp=-1"] == (pp, world_size // (pp * tp), tp) for seen in per_rank)


def test_single_plain_process():
    """No torchrun environment: build_mesh starts a private world of one."""
    layout = run_on_ranks(_plain_process_layout, 1, env={"RANK": "", "WORLD_SIZE": ""})[0]
    assert layout == ((1, 1, 1), (0, 0, 0), 0, 1)


def _plain_process_layout():
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    layout = mesh3d.build_mesh()
    return (layout.pp, layout.dp, layout.tp), layout.coordinate, layout.rank, layout.world_size


BAD_SIZES = [
    # (kwargs, words the message must contain)
    (dict(pp=3, dp=1, tp=1), ["pp*dp*tp=3", "world size=4"]),
    (dict(pp=2, dp=2, tp=2), ["pp*dp*tp=8", "world size=4"]),
    (dict(pp=3, dp=-1, tp=1), ["dp=-1", "pp*tp=3", "does not divide"]),
    (dict(pp=0, dp=-1, tp=4), ["pp and tp must be >= 1", "pp=0"]),
    (dict(pp=1, dp=-1, tp=0), ["pp and tp must be >= 1", "tp=0"]),
    (dict(pp=2, dp=0, tp=2), ["dp must be >= 1", "dp=0"]),
    (dict(pp=2.0, dp=2, tp=1), ["pp must be an int"]),
]


def _error_of(kwargs):
    try:
        mesh3d.build_mesh(**kwargs)
    except ValueError as e:
        return str(e)
    return None


def _bad_sizes_everywhere():
    """Each bad config must raise ValueError before the process group even exists."""
    messages = []
    for kwargs, _ in BAD_SIZES:
        messages.append(_error_of(kwargs))
        assert not dist.is_initialized(), f"{kwargs}: the process group was started before the error"
    # The same errors once a process group exists.
    mesh3d.build_mesh(pp=1, dp=-1, tp=1)
    again = [_error_of(kwargs) for kwargs, _ in BAD_SIZES]
    return messages, again


def test_bad_sizes_raise_on_every_rank():
    per_rank = run_on_ranks(_bad_sizes_everywhere, 4, timeout=60)
    for rank, (messages, again) in enumerate(per_rank):
        assert messages == again == per_rank[0][0]
        for (kwargs, words), message in zip(BAD_SIZES, messages):
            assert message is not None, f"rank {rank}: {kwargs} did not raise"
            for word in words + ["world size=4"]:
                assert word in message, (rank, kwargs, message)


def _mismatched_layouts():
    rank = int(os.environ["RANK"])
    pp, dp = (2, 1) if rank == 0 else (1, 2)
    return _error_of(dict(pp=pp, dp=dp, tp=1))


def test_mismatched_layouts_raise_on_every_rank():
    messages = run_on_ranks(_mismatched_layouts, 2, timeout=60)
    for message in messages:
        assert message is not None
        assert "rank 0: pp=2 dp=1 tp=1" in message and "rank 1: pp=1 dp=2 tp=1" in message
