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
or values computed in the forward from the version it used. On CUDA every write to the shards is
ordered against FSDP's all-gather streams (stream_order.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from mesh3d.distributed.shards import local_tensor
from mesh3d.pipeline.schedule.never_drain import UpdateRule
from mesh3d.pipeline.stream_order import shard_writes


def _set_settings(group: dict, settings: dict) -> None:
    """Put hyperparameters back into an optimizer's param group (a tensor in place, as schedulers keep it)."""
    for key, value in settings.items():
        current = group.get(key)
        if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor) and current.shape == value.shape:
            current.copy_(value)
        else:
            group[key] = value


class StageWeights:
    """Versions of some of a stage's parameters (all of them, or a tied weight's copy, which follows
    another stage's rule): `live` is in the parameters, `kept` holds copies of earlier ones."""

    def __init__(self, stage: nn.Module, params: list[nn.Parameter], rule_stage: int):
        self.params = params
        self.rule_stage = rule_stage  # whose update rule gives the versions (a tie: its first stage)
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
        with shard_writes(self.units):
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
        with shard_writes(self.units):  # the optimizer writes the shards; a backward may gather them next
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


@dataclass
class TiedCopy:
    """This rank's copy of a weight tied across stages (schedule/never_drain.py's TIE): on the
    first stage holding it (`primary`) it updates with that stage; on any other it has versions of
    its own, following the first stage's rule, and its gradients wait per update for the TIE."""

    param: nn.Parameter
    group: dist.ProcessGroup  # the pp ranks holding a copy (the same dp and tp coordinates)
    primary: bool
    weights: StageWeights | None = None  # a secondary copy's versions
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # secondary: gradient per update


class WeightVersions:
    """This rank's stages under a never-drain schedule: which version each action uses, and the
    updates, with the optimizer's hyperparameters as they were when the update's batch was handed
    to `pm.step` (a learning-rate schedule stepped between calls then moves every stage alike).

    `ties`: per stage of this rank, its copy of the weight tied across stages (param, the tie's
    process group, the first stage holding it)."""

    def __init__(
        self,
        stages: dict[int, nn.Module],
        rule: UpdateRule,
        optimizer: torch.optim.Optimizer,
        ties: dict[int, tuple[nn.Parameter, dist.ProcessGroup, int]] | None = None,
    ):
        self.rule = rule
        self.optimizer = optimizer
        self.ties: dict[int, TiedCopy] = {}
        self.stages: dict[int, StageWeights] = {}
        for index, stage in stages.items():
            params = list(stage.parameters())
            if index in (ties or {}):
                param, group, first = ties[index]
                copy = self.ties[index] = TiedCopy(param, group, primary=first == index)
                if not copy.primary:
                    params = [p for p in params if p is not param]
                    copy.weights = StageWeights(stage, [param], rule_stage=first)
            self.stages[index] = StageWeights(stage, params, rule_stage=index)
        self.next_backward = {index: 0 for index in stages}  # per stage: the next microbatch to backward
        self.hyperparameters: dict[int, list[dict]] = {}  # per call: each param group's settings

    def begin_call(self, call: int) -> None:
        # A copy: a scheduler may change a tensor-valued lr in place before this call's updates run.
        self.hyperparameters[call] = [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
            for g in self.optimizer.param_groups
        ]

    def _groups(self, stage: int) -> list[StageWeights]:
        copy = self.ties.get(stage)
        return [self.stages[stage]] + ([copy.weights] if copy is not None and copy.weights is not None else [])

    def oldest_needed(self, stage: int, weights: StageWeights) -> int:
        return self.rule.version(weights.rule_stage, self.next_backward[stage])

    def before_compute(self, stage: int, microbatch: int) -> None:
        """Before a forward or backward of `microbatch` on `stage`: its version in the parameters."""
        for weights in self._groups(stage):
            weights.use(self.rule.version(weights.rule_stage, microbatch), self.oldest_needed(stage, weights))

    def after_backward(self, stage: int, microbatch: int) -> None:
        self.next_backward[stage] = microbatch + 1
        copy = self.ties.get(stage)
        if copy is not None and not copy.primary and self.rule.completes_update(microbatch):
            # The copy's share of this update waits for the TIE; the next update accumulates anew.
            grad, copy.param.grad = copy.param.grad, None
            if grad is not None:
                copy.pending[self.rule.update_index(microbatch)] = grad

    def update(self, stage: int, microbatch: int) -> None:
        """U: the optimizer on `stage`'s accumulated gradients, from its newest version."""
        weights = self.stages[stage]
        call = microbatch // self.rule.microbatches
        weights.update(lambda: self._step(weights.params, call), self.oldest_needed(stage, weights))
        for old in [c for c in self.hyperparameters if c < call - 1]:
            del self.hyperparameters[old]

    def drop_pending(self) -> None:
        """After a failed call, or before weights are replaced: tied copies' gradients waiting for a TIE."""
        for copy in self.ties.values():
            copy.pending.clear()

    def tie(self, stage: int, microbatch: int) -> None:
        """TIE: the tied weight's gradient for this update summed over every copy. The first stage's
        copy then updates with its stage (the U that follows); any other copy updates here. A frozen
        weight joins the sum (every holder must) and stays as it is."""
        copy = self.ties[stage]
        frozen = not copy.param.requires_grad
        if copy.primary:
            grad = copy.param.grad if copy.param.grad is not None else torch.zeros_like(copy.param)
        else:
            grad = copy.pending.pop(self.rule.update_index(microbatch), None)
            grad = grad if grad is not None else torch.zeros_like(copy.param)
        dist.all_reduce(local_tensor(grad), group=copy.group)
        if copy.primary:
            copy.param.grad = None if frozen else grad
            return
        call = microbatch // self.rule.microbatches

        def step() -> None:
            if not frozen:
                copy.param.grad = grad
                self._step([copy.param], call)

        copy.weights.update(step, self.oldest_needed(stage, copy.weights))

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
        now = [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
            for g in self.optimizer.param_groups
        ]
        for group, settings in zip(self.optimizer.param_groups, self.hyperparameters.get(call, now)):
            _set_settings(group, settings)
        try:
            self.optimizer.step()
        finally:
            for group, settings in zip(self.optimizer.param_groups, now):
                _set_settings(group, settings)
            for p, grad in aside.items():
                p.grad = grad
        for p in params:
            p.grad = None

    def settle(self) -> None:
        """After a flush: every stage's newest weights in its parameters (evaluation, saving and
        the user see them); the versions the next calls still need stay kept."""
        for index in self.stages:
            for weights in self._groups(index):
                weights.use(weights.latest, self.oldest_needed(index, weights))

    def kept_bytes(self) -> int:
        return sum(w.kept_bytes() for index in self.stages for w in self._groups(index))

    def groups(self) -> list[StageWeights]:
        """Every group of versioned parameters on this rank (each stage's, each secondary tied copy's)."""
        return [w for index in self.stages for w in self._groups(index)]

    def updates(self) -> int:
        """Updates every group has applied; only meaningful after a flush (then they agree)."""
        counts = {w.latest for w in self.groups()}
        if len(counts) != 1:
            raise RuntimeError(f"weight groups at different update counts {sorted(counts)}: flush() first")
        return counts.pop()

    def needed_versions(self, next_microbatch: int, updates: int) -> list[tuple[StageWeights, list[int]]]:
        """After a flush with `updates` applied and `next_microbatch` next: the earlier versions
        each group must keep (those the next microbatches' rule still names)."""
        return [(w, list(range(self.rule.version(w.rule_stage, next_microbatch), updates))) for w in self.groups()]

    def restore(self, next_microbatch: int, updates: int, kept: dict[int, dict[int, list[torch.Tensor]]]) -> None:
        """A resumed state: `updates` applied (the parameters hold the newest version), microbatches
        numbered from `next_microbatch`, and each group's kept versions (by position in `groups`)."""
        for position, weights in enumerate(self.groups()):
            weights.latest = weights.live = updates
            weights.kept = dict(kept.get(position, {}))
        for index in self.next_backward:
            self.next_backward[index] = next_microbatch
        self.hyperparameters = {}
