"""mesh3d.train's BadStepGuard and BadLossGuard in one process: only consecutive non-finite steps count
towards the limit. (Skipping them on 8 ranks: tests/distributed/test_nonfinite.py.)"""

import pytest

from mesh3d.train import BadLossGuard, BadStepGuard, TooManyBadSteps


def test_bad_step_guard_counts_only_consecutive_steps():
    guard = BadStepGuard(max_bad_steps=2)
    assert guard.allows(1.0) and not guard.allows(float("nan"))
    guard.raise_if_too_many(2, float("nan"))
    assert guard.allows(0.5) and not guard.allows(float("inf"))  # a good step in between starts the count again
    guard.raise_if_too_many(4, float("inf"))
    assert not guard.allows(float("nan"))
    try:
        guard.raise_if_too_many(5, float("nan"))
    except TooManyBadSteps as error:
        assert "step 5" in str(error) and "2 steps in a row" in str(error)
    else:
        raise AssertionError("no TooManyBadSteps")
    assert guard.skipped == 3


def test_bad_loss_guard_counts_consecutive_non_finite_losses_and_skips_nothing():
    """The never-drain schedules' guard: the updates ran inside pm.step; it only stops the run."""
    guard = BadLossGuard(max_bad_steps=2)
    for step, loss in enumerate([2.0, float("nan"), 1.9, float("inf")], 1):
        guard.observe(loss)
        guard.raise_if_too_many(step, loss)  # never two in a row yet
    guard.observe(float("nan"))
    with pytest.raises(TooManyBadSteps, match=r"step 5: the loss was nan .* 2 steps in a row .*applied, not skipped"):
        guard.raise_if_too_many(5, float("nan"))
    assert guard.bad == 3 and not hasattr(guard, "allows")
