"""Weight versions and in-pipeline updates for the never-drain schedules (schedule/never_drain.py).

A stage's parameters hold one version of its weights at a time (the "live" one); the versions
later microbatches still need are kept as copies of the local shards. Before each forward and
backward the runtime asks for the version the schedule's `UpdateRule` gives that microbatch, and
an update (U) applies the optimizer to the newest version.

Why swapping values is exact: every stage of a never-drain schedule is wrapped by FSDP2 (over the
dp axis, or over one rank when dp = 1; DDP is FSDP2's `replicate`), so a forward's graph holds
the gathered (unsharded) parameters, never the live shards. Before the live shards change, every
FSDP unit of the stage is resharded; the next forward gathers the version it needs, and a
backward, whose FSDP pre-backward hook gathers again, sees the same version its forward saw.
Tensors a forward saved are either those gathered views, gathered again from the right version,
or values computed in the forward from the version it used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from mesh3d.distributed.shards import local_tensor
from mesh3d.pipeline.schedule.never_drain import UpdateRule


class StageWeights:
    """One stage's versions: `live` is in the parameters, `kept` holds copies of earlier ones."""

    def __init__(self, stage: nn.Module):
        self.params = [p for p in stage.parameters()]
        self.units = [m for m in stage.modules() if isinstance(m, FSDPModule)]
        self.live = 0  # the version the parameters hold
        self.latest = 0  # how many updates this stage has applied
        self.kept: dict[int, list[torch.Tensor]] = {}

    def _shards(self) -> list[torch.Tensor]:
        return [local_tensor(p.data) for p in self.params]

    def _reshard(self) -> None:
        for unit in self.units:
            unit.reshard()

    @torch.no_grad()
    def use(self, version: int, oldest_needed: int) -> None:
        """Put `version` into the parameters; keep the live one if a later microbatch needs it."""
        if version == self.live:
            return
        if version not in self.kept:
            raise RuntimeError(f"weight version {version} was not kept (live {self.live}, kept {sorted(self.kept)})")
        self._keep_live(oldest_needed)
        self._reshard()
        torch._foreach_copy_(self._shards(), self.kept.pop(version))
        self.live = version
        self.forget_before(oldest_needed)

    def _keep_live(self, oldest_needed: int) -> None:
        if self.live >= oldest_needed and self.live not in self.kept:
            self.kept[self.live] = [t.clone() for t in self._shards()]

    def update(self, step: Callable[[], None], oldest_needed: int) -> None:
        """Apply `step` (the optimizer on this stage's gradients) to the newest version."""
        self.use(self.latest, oldest_needed)
        with torch.no_grad():
            self._keep_live(oldest_needed)
        self._reshard()
        step()
        self.latest += 1
        self.live = self.latest
        self.forget_before(oldest_needed)

    def forget_before(self, oldest_needed: int) -> None:
        for version in [v for v in self.kept if v < oldest_needed]:
            del self.kept[version]

    def kept_bytes(self) -> int:
        """Bytes held by kept versions (the live one is the parameters' own)."""
        return sum(t.numel() * t.element_size() for copies in self.kept.values() for t in copies)


class WeightVersions:
    """This rank's stages under a never-drain schedule: which version each action uses, and the
    updates, with the optimizer's hyperparameters as they were when the update's batch was handed
    to `pm.step` (a learning-rate schedule stepped between calls then moves every stage alike)."""

    def __init__(self, stages: dict[int, nn.Module], rule: UpdateRule, optimizer: torch.optim.Optimizer):
        self.rule = rule
        self.optimizer = optimizer
        self.stages = {index: StageWeights(stage) for index, stage in stages.items()}
        self.next_backward = {index: 0 for index in stages}  # per stage: the next microbatch to backward
        self.hyperparameters: dict[int, list[dict]] = {}  # per call: each param group's settings

    def begin_call(self, call: int) -> None:
        self.hyperparameters[call] = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def oldest_needed(self, stage: int) -> int:
        return self.rule.version(stage, self.next_backward[stage])

    def before_compute(self, stage: int, microbatch: int) -> None:
        """Before a forward or backward of `microbatch` on `stage`: its version in the parameters."""
        self.stages[stage].use(self.rule.version(stage, microbatch), self.oldest_needed(stage))

    def after_backward(self, stage: int, microbatch: int) -> None:
        self.next_backward[stage] = microbatch + 1

    def update(self, stage: int, microbatch: int) -> None:
        """U: the optimizer on `stage`'s accumulated gradients, from its newest version."""
        weights = self.stages[stage]
        call = microbatch // self.rule.microbatches
        weights.update(lambda: self._step(weights.params, call), self.oldest_needed(stage))
        for old in [c for c in self.hyperparameters if c < call - 1]:
            del self.hyperparameters[old]

    def _step(self, params: list[nn.Parameter], call: int) -> None:
        """optimizer.step() on `params` only (others' gradients set aside), with call's settings;
        then their gradients are cleared."""
        mine = {id(p) for p in params}
        aside = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in mine and p.grad is not None:
                    aside[p] = p.grad
                    p.grad = None
        now = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        for group, settings in zip(self.optimizer.param_groups, self.hyperparameters.get(call, now)):
            group.update(settings)
        try:
            self.optimizer.step()
        finally:
            for group, settings in zip(self.optimizer.param_groups, now):
                group.update(settings)
            for p, grad in aside.items():
                p.grad = grad
        for p in params:
            p.grad = None

    def settle(self) -> None:
        """After a flush: every stage's newest weights in its parameters (evaluation, saving and
        the user see them); the versions the next calls still need stay kept."""
        for index, weights in self.stages.items():
            weights.use(weights.latest, self.oldest_needed(index))

    def kept_bytes(self) -> int:
        return sum(w.kept_bytes() for w in self.stages.values())
