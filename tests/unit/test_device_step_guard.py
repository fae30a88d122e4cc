"""DeviceStepGuard: a non-finite norm skips a fused AdamW's whole update on the device (weights,
moments and step count as before, against a copy taken before), the run of bad steps is read only
when asked, and an optimizer that cannot skip on the device is refused by name."""

import pytest
import torch
from host_syncs import HostSyncCounter

from mesh3d.train import TooManyBadSteps
from mesh3d.train.device_step_guard import DeviceStepGuard


def _stepped(optimizer, guard, param, grad: float) -> torch.Tensor:
    param.grad = torch.full_like(param, grad)
    return guard.step(optimizer, param.grad.norm())


def test_a_non_finite_step_is_skipped_on_the_device_and_counted_late():
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
    guard = DeviceStepGuard(max_bad_steps=2)
    _stepped(optimizer, guard, param, 0.5)
    before = param.detach().clone(), {k: v.clone() for k, v in optimizer.state[param].items()}
    with HostSyncCounter() as syncs:
        skipped = _stepped(optimizer, guard, param, float("nan"))
    assert not syncs.ops, syncs.ops
    assert bool(skipped) and torch.equal(param.detach(), before[0])
    assert all(torch.equal(v, optimizer.state[param][k]) for k, v in before[1].items())
    guard.raise_if_too_many(2)  # one bad step: fine
    assert not bool(_stepped(optimizer, guard, param, 0.5)) and not torch.equal(param.detach(), before[0])
    _stepped(optimizer, guard, param, float("inf"))
    _stepped(optimizer, guard, param, float("nan"))
    _stepped(optimizer, guard, param, 0.5)  # the run ended before the read: still counted
    with pytest.raises(TooManyBadSteps, match="2 steps in a row"):
        guard.raise_if_too_many(6)
    guard.raise_if_too_many(7)  # read: the run is forgotten


def test_an_optimizer_that_cannot_skip_on_the_device_is_refused():
    param = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="fused=True"):
        _stepped(torch.optim.AdamW([param], lr=0.1), DeviceStepGuard(), param, 1.0)
