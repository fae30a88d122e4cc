"""A parameter the tp plan leaves replicated but that multiplies a tp-sharded activation gets the whole
gradient (mesh3d/tensor/partial_gradients.py), checked against the same model in one process.

The toy: a scale on the whole input, then up (column-wise) -> a learned activation slope -> down
(row-wise). Only the slope sees a slice; left plain, its gradient is one rank's part (the kind of
difference Apertus' xIELU `act_fn.alpha_p` showed, with the loss exact). Then Apertus itself, tiny,
through mesh3d.parallelize at (1,1,2): every parameter after two SGD steps equals transformers'
own model trained in one process.
"""

from __future__ import annotations

import hf_cases
import pytest
import torch
from multiprocess import run_on_ranks
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

WIDTH, HIDDEN = 6, 8
PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


class Slope(nn.Module):
    def __init__(self, size: int | None = None):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((size or 1,), 0.7))

    def forward(self, x):
        return self.alpha * x * x


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale, self.up, self.act, self.down = Slope(WIDTH), nn.Linear(WIDTH, HIDDEN), Slope(), nn.Linear(HIDDEN, 2)

    def forward(self, x):
        return self.down(self.act(self.up(self.scale(x))))


def _gradients(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    from mesh3d.tensor.gradients import settle_gradients

    model(x).square().sum().backward()
    settle_gradients(model.parameters())
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {n: (g.full_tensor() if isinstance(g, DTensor) else g).clone() for n, g in grads.items()}


def _on_rank() -> dict:
    import mesh3d
    from mesh3d.tensor.apply import apply_tensor_parallel
    from mesh3d.tensor.partial_gradients import modules_seeing_shards, replicate_on_shards

    tp_mesh = mesh3d.build_mesh(pp=1, dp=1, tp=2).mesh["tp"]
    torch.manual_seed(0)
    x = torch.randn(3, WIDTH)
    whole = Toy()
    state = whole.state_dict()
    out = {"whole": _gradients(whole, x)}
    with torch.device("meta"):
        meta = Toy()
    out["seeing"] = modules_seeing_shards(
        [meta], lambda: apply_tensor_parallel([meta], PLAN, tp_mesh), lambda: meta(torch.empty(3, WIDTH, device="meta"))
    )
    for fixed in (False, True):
        model = Toy()
        model.load_state_dict(state)
        apply_tensor_parallel([model], PLAN, tp_mesh)
        if fixed:
            replicate_on_shards([model], out["seeing"], tp_mesh)
        out[fixed] = _gradients(model, x)
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=2)
    data = hf_cases.masked_batches(4)
    out["apertus"] = hf_cases.pipeline_run("apertus", layout, data, schedule="gpipe", microbatches=2)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_on_rank, 2, timeout=240)


def test_the_module_fed_a_slice_is_found_and_only_it(ranks):
    assert all(rank["seeing"] == ["act"] for rank in ranks)


def test_its_gradient_is_whole_with_the_fix_and_one_part_without(ranks):
    for rank in ranks:
        whole, plain, fixed = rank["whole"], rank[False], rank[True]
        for name, want in whole.items():
            torch.testing.assert_close(fixed[name], want, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(plain["act.alpha"], whole["act.alpha"], rtol=1e-3)  # the difference missed before
        torch.testing.assert_close(plain["scale.alpha"], whole["scale.alpha"])  # a whole input: right as it was


def test_apertus_is_exact_under_tensor_parallelism(ranks):
    reference = hf_cases.reference_run("apertus", hf_cases.masked_batches(4))
    error, where = hf_cases.worst_error(ranks[0]["apertus"], reference)
    assert error <= hf_cases.TOLERANCE, (where, error)
    assert "model.layers.0.mlp.act_fn.alpha_p" in reference[1]
