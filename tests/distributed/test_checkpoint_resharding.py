"""Save at layout A after 2 steps, load at layout B, train 2 more: the same as 4 uninterrupted steps at A.

Layouts among (1,1,1), (2,2,2), (4,1,2), (2,4,1), (1,2,4), (8,1,1); 5 pairs change pp (2 -> 4,
1 -> 2, 8 -> 1, 2 -> 1), tp (2 -> 1, 1 -> 4), dp (2 -> 1, 2 -> 4, 1 -> 4, 4 -> 1, 1 -> 2), the world
size (1 -> 8, 8 -> 1), the schedule and virtual stages (2 -> 1), and FSDP <-> DDP; tied and untied.
Batches come from the DistributedLoader, resumed from the saved data position under the new dp
degree. B starts from other weights (seed 1) and a fresh optimizer, so everything it matches came
from the checkpoint. Losses of steps 3-4 and every parameter after step 4: relative error <= 1e-5.

Four launches: the A runs of 8 ranks, the A run of one rank, then the B runs of each world size.
"""

from __future__ import annotations

import pytest
from checkpoint_cases import build, full_state, train, worst_relative_error
from multiprocess import run_on_ranks
from pipeline_cases import TOLERANCE

import mesh3d

# name: (layout, tied, parallelize options)
SAVED = {
    "222T": ((2, 2, 2), True, {}),
    "811U": ((8, 1, 1), False, {}),
    "241T": ((2, 4, 1), True, {"schedule": "1f1b", "dp_mode": "ddp"}),
    "111T": ((1, 1, 1), True, {}),
}
# (saved, layout B, options B): what each pair changes is in the comment. Each axis grows and
# shrinks once; the 8-rank pairs with tp on both sides cost the most and are kept few.
PAIRS = [
    ("222T", (4, 1, 2), {"schedule": "1f1b"}),  # pp 2 -> 4, dp 2 -> 1, v 2 -> 1
    ("222T", (2, 4, 1), {"dp_mode": "ddp"}),  # tp 2 -> 1, dp 2 -> 4, FSDP -> DDP
    ("811U", (1, 2, 4), {}),  # pp 8 -> 1, tp 1 -> 4, dp 1 -> 2
    ("111T", (2, 4, 1), {}),  # one process -> 8 ranks, pp 1 -> 2, dp 1 -> 4
    ("241T", (1, 1, 1), {}),  # 8 ranks (DDP, 1F1B) -> one process
]


def _world(layout) -> int:
    return layout[0] * layout[1] * layout[2]


_layouts: dict = {}


def _layout(sizes):
    if sizes not in _layouts:
        _layouts[sizes] = mesh3d.build_mesh(*sizes)
    return _layouts[sizes]


def _save_runs(root: str, world: int) -> dict:
    """Each saved case: 2 steps, save, 2 more steps (the uninterrupted run)."""
    results = {}
    for name, (sizes, tied, options) in SAVED.items():
        if _world(sizes) != world:
            continue
        layout = _layout(sizes)
        pm, optimizer, loader = build(layout, tied, **options)
        losses = train(pm, optimizer, loader, 2)
        mesh3d.checkpoint.save(f"{root}/{name}", pm, optimizer, step=2, data_state=loader.state_dict())
        losses += train(pm, optimizer, loader, 2)
        results[name] = (losses, full_state(pm))
    return results


def _load_runs(root: str, world: int) -> dict:
    results = {}
    for index, (name, sizes, options) in enumerate(PAIRS):
        if _world(sizes) != world:
            continue
        layout = _layout(sizes)
        pm, optimizer, loader = build(layout, SAVED[name][1], init_seed=1, **options)
        state = mesh3d.checkpoint.load(f"{root}/{name}", pm, optimizer)
        loader.load_state_dict(state["data_state"])
        losses = train(pm, optimizer, loader, 2)
        results[index] = (state["step"], losses, full_state(pm))
    return results


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    saved = run_on_ranks(_save_runs, 8, root, 8, timeout=600)[0]
    saved |= run_on_ranks(_save_runs, 1, root, 1, timeout=120)[0]
    loaded = run_on_ranks(_load_runs, 8, root, 8, timeout=600)[0]
    loaded |= run_on_ranks(_load_runs, 1, root, 1, timeout=120)[0]
    return saved, loaded


@pytest.mark.parametrize("index", range(len(PAIRS)), ids=[f"{n}->{''.join(map(str, b))}" for n, b, _ in PAIRS])
def test_resume_under_another_layout_equals_uninterrupted_run(resumed, index):
    saved, loaded = resumed
    name = PAIRS[index][0]
    uninterrupted_losses, uninterrupted_state = saved[name]
    step, losses, state = loaded[index]
    assert step == 2
    loss_errors = [abs(a - b) / abs(b) for a, b in zip(losses, uninterrupted_losses[2:])]
    assert max(loss_errors) <= TOLERANCE, (losses, uninterrupted_losses)
    error, where = worst_relative_error(state, uninterrupted_state)
    assert error <= TOLERANCE, f"relative error {error:.2e} at {where}"
