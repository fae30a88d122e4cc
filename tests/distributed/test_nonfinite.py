"""Non-finite steps (issue 16) at (pp, dp, tp) = (2, 2, 2) on 8 ranks, with mesh3d.train's BadStepGuard.

A NaN put into one rank's gradient makes pm.clip_grad_norm_ return NaN on every rank; the guard
skips that optimizer step everywhere, the weights stay exactly as they were, and the next good
step equals that of a run which never saw the bad step (fp32, rel 1e-5). Three bad steps in a row
raise TooManyBadSteps on every rank. A NaN weight on one rank makes checkpoint.save refuse, on
every rank, naming the parameter.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from checkpoint_cases import full_state, worst_relative_error
from multiprocess import run_on_ranks
from pipeline_cases import LR, MAX_NORM, TOLERANCE, batches, meta_model, tp_args

import mesh3d
from examples.llama.model import loss_fn
from mesh3d.distributed.shards import local_tensor
from mesh3d.train import BadStepGuard, TooManyBadSteps

POISONED_RANK = 5


def _build(layout):
    pm = mesh3d.parallelize(meta_model(False, args=tp_args(False, 4)), layout, loss_fn=loss_fn, microbatches=2)
    return pm, torch.optim.AdamW(pm.parameters(), lr=LR)


def _step(pm, optimizer, guard, batch, step: int, poison: bool = False) -> tuple[float, bool]:
    """One train.py step: forward-backward, clip, the guard's verdict, the optimizer if allowed."""
    loss = pm.step(*batch).item()
    if poison and dist.get_rank() == POISONED_RANK:
        grad = next(p.grad for p in pm.parameters() if p.grad is not None)
        local_tensor(grad).view(-1)[0] = float("nan")
    norm = pm.clip_grad_norm_(MAX_NORM).item()
    stepped = guard.allows(norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad()
    guard.raise_if_too_many(step, norm)
    return loss, stepped


def _skip_and_stop() -> dict:
    layout = mesh3d.build_mesh(pp=2, dp=2, tp=2)
    first, second, third = batches(8, steps=3)
    pm, optimizer = _build(layout)
    guard = BadStepGuard(max_bad_steps=3)
    _step(pm, optimizer, guard, first, 1)
    before = full_state(pm)
    _, stepped = _step(pm, optimizer, guard, second, 2, poison=True)
    unchanged = all(np.array_equal(v, before[k]) for k, v in full_state(pm).items())
    loss_after, _ = _step(pm, optimizer, guard, third, 3)
    after = full_state(pm)

    reference, reference_optimizer = _build(layout)
    reference_guard = BadStepGuard()
    _step(reference, reference_optimizer, reference_guard, first, 1)
    want_loss, _ = _step(reference, reference_optimizer, reference_guard, third, 2)
    result = {
        "skipped": not stepped,
        "unchanged": unchanged,
        "loss": (loss_after, want_loss),
        "error": worst_relative_error(after, full_state(reference)),
    }

    stops = []
    for step in range(4, 7):
        try:
            stops.append(_step(pm, optimizer, guard, first, step, poison=True)[1])
        except TooManyBadSteps as error:
            stops.append(str(error))
    result["stops"] = stops

    if layout.rank == POISONED_RANK:
        with torch.no_grad():
            local_tensor(next(iter(pm.parameters()))).view(-1)[0] = float("inf")
    try:
        mesh3d.checkpoint.save("/nonexistent/never-written/step9", pm, optimizer, step=9)
        result["save"] = "saved"
    except ValueError as error:
        result["save"] = str(error)
    result["poisoned_name"] = next(iter(dict(pm.named_parameters()))) if layout.rank == POISONED_RANK else None
    return result


def test_nan_steps_are_skipped_then_stop_the_run_and_nan_weights_are_not_saved():
    results = run_on_ranks(_skip_and_stop, 8, timeout=180)
    poisoned_name = results[POISONED_RANK]["poisoned_name"]
    for rank, result in enumerate(results):
        assert result["skipped"] and result["unchanged"], (rank, result)
        got, want = result["loss"]
        assert abs(got - want) <= TOLERANCE * abs(want), (rank, got, want)
        error, at = result["error"]
        assert error <= TOLERANCE, (rank, error, at)
        assert result["stops"][:2] == [False, False], (rank, result["stops"])
        assert "in 3 steps in a row (max_bad_steps=3)" in result["stops"][2], (rank, result["stops"])
        assert f"parameter {poisoned_name} holds NaN or Inf" in result["save"], (rank, result["save"])
