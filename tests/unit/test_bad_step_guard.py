"""mesh3d.train's BadStepGuard in one process: only consecutive non-finite steps count towards the limit.
(Skipping them on 8 ranks: tests/distributed/test_nonfinite.py.)"""

from mesh3d.train import BadStepGuard, TooManyBadSteps


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
