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
"""

from __future__ import annotations

import math


class TooManyBadSteps(RuntimeError):
    """`max_bad_steps` optimizer steps in a row had a non-finite gradient norm."""


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
