"""Non-finite steps: skip the optimizer step whose gradient norm is NaN or Inf, stop after too many in a row.

    guard = BadStepGuard(max_bad_steps=3)
    grad_norm = pm.clip_grad_norm_(1.0).item()
    if guard.allows(grad_norm):
        optimizer.step()
    guard.raise_if_too_many(step, grad_norm)   # after logging the step

A NaN or Inf anywhere in the gradients makes the global gradient norm (`pm.clip_grad_norm_`,
the same value on every rank) NaN or Inf, so every rank reaches the same verdict from it with no
extra communication. Skipping the update keeps the weights (and the optimizer's moments) finite;
a run whose steps keep failing is stopped instead of burning its budget on skipped steps.

The never-drain schedules ("pipedream", "pipedream_2bw") update the weights inside `pm.step`,
stage by stage, with no moment at which the whole gradient exists: there is no norm to test
before the update and no update left to skip. `BadLossGuard` is their guard: it counts the steps
in a row whose loss (the same on every rank) is NaN or Inf and stops the run after
`max_bad_steps` of them, through the same TooManyBadSteps.

    guard = BadLossGuard(max_bad_steps=3)
    loss = pm.step(inputs, targets).item()   # the updates ran inside
    guard.observe(loss)
    guard.raise_if_too_many(step, loss)      # after logging the step
"""

from __future__ import annotations

import math


class TooManyBadSteps(RuntimeError):
    """`max_bad_steps` optimizer steps in a row had a non-finite gradient norm (or, never-drain, loss)."""


class BadStepGuard:
    """Counts consecutive non-finite steps: `allows(grad_norm)` says whether to step the optimizer,
    `raise_if_too_many(step)` (once the step is logged) stops the run."""

    def __init__(self, max_bad_steps: int = 3) -> None:
        if max_bad_steps < 1:
            raise ValueError(f"max_bad_steps must be >= 1, got {max_bad_steps}")
        self.max_bad_steps = max_bad_steps
        self.consecutive = 0
        self.skipped = 0  # over the whole run

    def allows(self, grad_norm: float) -> bool:
        """True for a finite norm (and the count of bad steps in a row starts again); False for a
        step to skip."""
        if math.isfinite(grad_norm):
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.skipped += 1
        return False

    def raise_if_too_many(self, step: int, grad_norm: float) -> None:
        """Raise TooManyBadSteps once max_bad_steps non-finite steps came in a row."""
        if self.consecutive >= self.max_bad_steps:
            raise TooManyBadSteps(
                f"step {step}: the gradient norm was {grad_norm} (non-finite) in {self.consecutive} steps in a row "
                f"(max_bad_steps={self.max_bad_steps}); their optimizer steps were skipped and the weights are "
                "those before them. Lower the learning rate, check the data of these steps, or resume from an "
                "earlier checkpoint"
            )


class BadLossGuard:
    """Counts consecutive steps with a non-finite loss, for schedules that update inside `pm.step`
    (never-drain): `observe(loss)` every step, `raise_if_too_many(step, loss)` (once the step is
    logged) stops the run. Nothing is skipped: those updates have happened."""

    def __init__(self, max_bad_steps: int = 3) -> None:
        if max_bad_steps < 1:
            raise ValueError(f"max_bad_steps must be >= 1, got {max_bad_steps}")
        self.max_bad_steps = max_bad_steps
        self.consecutive = 0
        self.bad = 0  # over the whole run

    def observe(self, loss: float) -> None:
        """Count a non-finite loss; a finite one starts the count of bad steps in a row again."""
        if math.isfinite(loss):
            self.consecutive = 0
        else:
            self.consecutive += 1
            self.bad += 1

    def raise_if_too_many(self, step: int, loss: float) -> None:
        """Raise TooManyBadSteps once max_bad_steps non-finite losses came in a row."""
        if self.consecutive >= self.max_bad_steps:
            raise TooManyBadSteps(
                f"step {step}: the loss was {loss} (non-finite) in {self.consecutive} steps in a row "
                f"(max_bad_steps={self.max_bad_steps}); a never-drain schedule updates inside the pipeline, so "
                "these updates were applied, not skipped. Lower the learning rate, check the data of these "
                "steps, or resume from an earlier checkpoint"
            )
