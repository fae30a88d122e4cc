"""Non-finite steps skipped and counted on the device, so that a step between logging steps reads
nothing back (torchtitan's rule; issue 65).

    guard = DeviceStepGuard(max_bad_steps=3)
    optimizer = torch.optim.AdamW(params, fused=True)       # its step takes `found_inf`
    norm = pm.clip_grad_norm_(1.0)                          # on the device, unread
    skipped = guard.step(optimizer, norm)                   # the update skipped on the device if non-finite
    if logging_step:
        guard.raise_if_too_many(step)                        # the one read, on logging steps only

`BadStepGuard` (nonfinite_steps.py) decides on the host, so it reads the norm every step. Here the
verdict stays a tensor: the optimizer's step is handed it as `found_inf`, the flag torch's
GradScaler hands fused optimizers (fused Adam, AdamW and SGD skip the whole update where it is 1,
their step counter too: weights and moments stay as they were), and the run of bad steps in a
row is counted on the device. The norm is the same on every rank, so every rank skips alike.
`raise_if_too_many` reads the longest run since its last call: a run of max_bad_steps skipped
steps stops the training at the next logging step instead of at once, which costs time but no
weights (those steps were skipped). `observe` is the never-drain form (`BadLossGuard`'s): the
updates ran inside `pm.step`, so only the losses are counted.
"""

from __future__ import annotations

import torch

from mesh3d.train.nonfinite_steps import TooManyBadSteps


class DeviceStepGuard:
    """Skips and counts non-finite steps on the device (see the module docstring)."""

    def __init__(self, max_bad_steps: int = 3) -> None:
        if max_bad_steps < 1:
            raise ValueError(f"max_bad_steps must be >= 1, got {max_bad_steps}")
        self.max_bad_steps = max_bad_steps
        self._in_a_row: torch.Tensor | None = None  # bad steps in a row up to the last one, on the device
        self._longest: torch.Tensor | None = None  # the longest such run since the last read
        self._last: torch.Tensor | None = None  # the last value observed

    def step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
        """Step `optimizer` unless `grad_norm` is NaN or Inf, decided on the device; the verdict
        (a 0-dim bool tensor, True: skipped), unread. The optimizer must take `found_inf` (fused)."""
        fused = all(group.get("fused") for group in optimizer.param_groups)  # a loaded state sets the groups too
        if not (getattr(optimizer, "_step_supports_amp_scaling", False) and fused):
            raise ValueError(
                f"DeviceStepGuard.step: {type(optimizer).__name__} cannot skip its step on the device; build it "
                "with fused=True (torch's fused Adam, AdamW and SGD take `found_inf`), or use BadStepGuard, which "
                "reads the gradient norm on the host every step"
            )
        bad = self.observe(grad_norm)
        optimizer.grad_scale = None  # torch's fused step reads both attributes, as GradScaler sets them
        optimizer.found_inf = bad.to(torch.float32)
        try:
            optimizer.step()
        finally:
            optimizer.found_inf = None
        return bad

    def step_on_host(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
        """`step` for an optimizer that cannot take `found_inf`: the verdict read on the host, one
        sync a step (torch's fused AdamW refuses a parameter list mixing plain tensors and DTensors,
        as a Hugging Face TP plan leaves them); counted alike."""
        bad = self.observe(grad_norm)
        if not bool(bad):
            optimizer.step()
        return bad

    def observe(self, value: torch.Tensor) -> torch.Tensor:
        """Count `value` (a gradient norm, or a never-drain step's loss) as a bad step if NaN or Inf;
        the verdict (True: bad), unread."""
        bad = ~torch.isfinite(value.detach())
        if self._in_a_row is None:
            self._in_a_row = torch.zeros((), dtype=torch.long, device=bad.device)
            self._longest = torch.zeros_like(self._in_a_row)
        self._in_a_row = torch.where(bad, self._in_a_row + 1, 0)
        self._longest = torch.maximum(self._longest, self._in_a_row)
        self._last = value.detach()
        return bad

    def raise_if_too_many(self, step: int) -> None:
        """Raise TooManyBadSteps where max_bad_steps bad steps came in a row since the last call
        (one host read), every rank alike (their values are the same)."""
        if self._longest is None:
            return
        longest, last = torch.stack([self._longest.double(), self._last.double()]).tolist()
        self._longest = self._in_a_row.clone()
        if longest >= self.max_bad_steps:
            raise TooManyBadSteps(
                f"by step {step}: {int(longest)} steps in a row had a non-finite gradient norm or loss (the last "
                f"{last}; max_bad_steps={self.max_bad_steps}); a skipped step's weights are those before it (a "
                "never-drain schedule's updates ran inside the pipeline). Lower the learning rate, check the data "
                "of these steps, or resume from an earlier checkpoint"
            )
