"""The step's loss over the whole global batch: what kind of loss it is, how each microbatch's
loss is scaled before its backward, and the value every rank returns after the step.

The loss contract itself (a mean or a (loss_sum, count) pair, the default loss) is in loss.py.
`parallelize` hands the loss function here, and only here; the pipeline runtime gets it back for
one step at a time, wrapped with that step's scale (`ScaledLoss`). Per step:

1. the kind: from a meta run of the loss on every rank (no communication); a loss that cannot
   run on meta tensors is called once, on the last stage's real targets and a zero output, and
   the verdict or the error reaches every rank through one all-gather. Either way it is found
   once per input shape and remembered;
2. for a pair loss, the global count, before the first backward: the last stage's ranks count
   their targets (the loss's `count(target)`, or the loss called on a zero output) and add the
   counts over dp (and cp: each cp rank counts its tokens' targets) with one small all-reduce
   among themselves;
3. after the schedule, one world all-reduce of (sum of loss values, sum of counts, router
   terms, the step's device checks) gives every rank the global loss, returned unread on the
   compute device: the step stops the host nowhere (the count of step 2 stays on the device, and
   so do the divisors made of it); the checks are judged by the next call (late_verdicts.py).

A mixture of experts whose config asks for the router's load-balancing loss (model/router_aux.py)
hands the last stage its microbatch's routing sums beside the output; the loss adds
`coef x aux / (dp x m)` per microbatch: what one process accumulating the same dp x m microbatches
computes, each microbatch's term at that weight (and the whole term to each update of a schedule
whose every microbatch is an update of its own).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mesh3d.context_parallel.call_verdicts import StepVerdicts
from mesh3d.distributed.agree import gather_or_raise
from mesh3d.distributed.host_to_device import to_device
from mesh3d.mesh import Layout
from mesh3d.model.loss import (
    IGNORE_INDEX,
    MEAN,
    PAIR,
    LossFn,
    LossScale,
    check_loss_on_meta,
    probe_counts,
    probe_kind,
)
from mesh3d.model.router_aux import RouterAux
from mesh3d.pipeline.boundary import Boundaries
from mesh3d.step.late_verdicts import LateVerdicts


@dataclass(frozen=True)
class RouterTerm:
    """The router's load-balancing loss as one step adds it, per microbatch: `backward_weight` x
    this rank's part of it into the tensor backpropagated (data parallelism then averages over
    dp x cp), `report_weight` x it into the value reported (summed over the world)."""

    aux: RouterAux
    backward_weight: float
    report_weight: float
    group: object | None  # the cp ranks sharing a microbatch's tokens (None at cp = 1)

    def __call__(self, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.group is not None:
            sums = self.aux.over_group(sums, self.group)
        part = self.aux.loss(sums)
        return part.detach().float() * self.report_weight, part * self.backward_weight


@dataclass(frozen=True)
class ScaledLoss:
    """The loss of one step or evaluation as the last stage computes it (the pipeline runtime's
    MicrobatchLoss): loss_fn under its context, scaled before backward so that gradients
    accumulate to those of the global loss; with a router term, the output comes with the
    microbatch's routing sums and their loss is added."""

    loss_fn: LossFn
    context: Callable[[], AbstractContextManager]
    scale: LossScale
    router: RouterTerm | None = None

    def __call__(
        self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], target: torch.Tensor, microbatch: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        sums = None
        if self.router is not None:
            output, sums = output
        with self.context():
            result = self.loss_fn(output, target)
        value, count, scaled = self.scale.apply(result, microbatch)
        if sums is None:
            return value, count, scaled, torch.zeros((), device=value.device)
        reported, term = self.router(sums)
        return value, count, scaled + term.to(scaled.dtype), reported


class GlobalLoss:
    """The loss side of a ParallelModel's steps (see the module docstring).

    Args:
        layout: this rank's Layout.
        loss_fn: the user's loss (or the default), see loss.py.
        loss_context: a factory of the context the loss and its backward run in (tensor
            parallelism's loss_parallel).
        microbatches: microbatches per step.
        has_last_stage: whether this rank holds the last stage (computes the loss).
        per_microbatch: every microbatch's gradient is an update of its own (schedule
            "pipedream"): each is scaled as a whole batch would be (a mean: by 1; a pair: by its
            own global count, over the dp ranks' microbatches of the same index).
        router_aux: the model's router load-balancing loss, added to every microbatch's (None:
            the model has none, or its config does not ask for it).
    """

    def __init__(
        self,
        layout: Layout,
        loss_fn: LossFn,
        loss_context: Callable[[], AbstractContextManager],
        microbatches: int,
        has_last_stage: bool,
        per_microbatch: bool = False,
        router_aux: RouterAux | None = None,
    ):
        self.router_aux = router_aux
        self.per_microbatch = per_microbatch  # each microbatch is a minibatch of its own ("pipedream")
        self.layout = layout
        self.loss_fn = loss_fn
        self.loss_context = loss_context
        self.microbatches = microbatches
        self.has_last_stage = has_last_stage
        self._kinds: dict[tuple, str] = {}  # by microbatch input and target shapes and dtypes
        self._terms: torch.Tensor | None = None  # the last call's [loss_fn, router_aux], unread (`total`)
        self.late = LateVerdicts()  # the last call's device checks, judged by the next (late_verdicts.py)

    @property
    def ignore_index(self) -> int:
        """The target value the loss does not count (the loss's own `ignore_index`, else -100)."""
        return getattr(self.loss_fn, "ignore_index", IGNORE_INDEX)

    def kind(self, boundaries: Boundaries, inputs: torch.Tensor, targets: torch.Tensor) -> str:
        """MEAN or PAIR, the same on every rank; a loss whose result is neither raises on every rank."""
        m = self.microbatches
        microbatch, target = inputs[: len(inputs) // m], targets[: len(targets) // m]
        key = (tuple(microbatch.shape), microbatch.dtype, tuple(target.shape), target.dtype)
        if key not in self._kinds:
            kind = check_loss_on_meta(self.loss_fn, boundaries.output, target, self.loss_context)
            if kind is None:  # cannot run on meta: ask the last stage, which holds the real output's layout
                found, error = None, None
                if self.has_last_stage:
                    try:
                        device_target = target.to(self.layout.device)
                        found = probe_kind(self.loss_fn, boundaries.output, device_target, self.loss_context)
                    except Exception as failure:  # noqa: BLE001 - every rank must raise it, not only this one
                        error = f"loss_fn failed before the step on the last stage: {type(failure).__name__}: {failure}"
                kinds = {k for k in gather_or_raise(found, error) if k is not None}
                kind = kinds.pop()
            self._kinds[key] = kind
        return self._kinds[key]

    def for_step(self, boundaries: Boundaries, kind: str, targets: torch.Tensor) -> ScaledLoss:
        """The loss of a training step, as the last stage computes it: scaled by 1/m for a mean
        loss; for a pair loss by the global count, found here before the first backward."""
        scale = self._scale(boundaries, kind, targets)
        return ScaledLoss(self.loss_fn, self.loss_context, scale, self._router_term(train=True))

    def for_evaluation(self, kind: str) -> ScaledLoss:
        """The loss of a forward-only pass: nothing is backpropagated, the values are all that count."""
        return ScaledLoss(self.loss_fn, self.loss_context, LossScale(kind, divisor=1.0), self._router_term(False))

    def _router_term(self, train: bool) -> RouterTerm | None:
        """coef x aux / (dp x m) per microbatch (module docstring). Data parallelism averages the
        gradients over dp x cp, and a microbatch's loss is the sum of its cp ranks' parts: each
        part goes backward times cp / m (times cp where every microbatch is an update of its own)."""
        if self.router_aux is None:
            return None
        layout, m, coef = self.layout, self.microbatches, self.router_aux.coef
        per_update = 1 if self.per_microbatch else m
        group = layout.group("cp") if layout.cp > 1 else None
        backward = coef * layout.cp / per_update if train else 0.0
        return RouterTerm(self.router_aux, backward, coef / (layout.dp * m), group)

    def _scale(self, boundaries: Boundaries, kind: str, targets: torch.Tensor) -> LossScale:
        m = self.microbatches
        if kind == MEAN:
            return LossScale(MEAN, 1.0 if self.per_microbatch else float(m))
        if not self.has_last_stage:
            return LossScale(PAIR, 0.0)  # never applied here
        chunks = to_device(targets, self.layout.device).chunk(m)
        local = torch.stack(probe_counts(self.loss_fn, boundaries.output, chunks, self.loss_context)).long()
        # The counts stay on the device: the divisors are tensors there, so no host read waits for them.
        each = local.clone()  # the global count of each microbatch index, once reduced over dp (x cp)
        dp = self.layout.data_parallel_size  # FSDP/DDP average over dp x cp: each rank's part counts 1/dp
        if dp > 1:
            dist.all_reduce(each, group=self.layout.data_group())
        divisor = (each.sum().double() / dp).float()
        if self.per_microbatch:
            return LossScale(PAIR, divisor, local.sum(), (each.double() / dp).float())
        return LossScale(PAIR, divisor, local.sum())

    def total(
        self, totals: torch.Tensor, loss: ScaledLoss | None = None, verdicts: StepVerdicts | None = None
    ) -> torch.Tensor:
        """Every rank's [loss values, counts, router terms] summed over the world: the global loss,
        on every rank, a 0-dim float32 tensor on the compute device, unread (reading it is the
        caller's one host sync); `terms` reads its parts when asked.

        Only last-stage ranks at tp rank 0 contribute (the other tp ranks hold the same values).
        The step's checks that are device values travel in the same all-reduce and are judged one
        call late (late_verdicts.py): given the step's `loss`, a pair loss whose counts during the
        step differ from those found before it (a count that depends on the output) is an error on
        every rank, the gradients were scaled wrongly; given the step's context-parallel attention
        `verdicts`, a refused call on any rank is an error on every rank (call_verdicts.py). Here
        the previous call's are judged, and raise.
        """
        mine = totals.detach() if self.layout.tp_rank == 0 else torch.zeros_like(totals)
        scale = loss.scale if loss is not None else None
        if scale is not None and scale.kind == PAIR:
            recount = (totals[1] != scale.expected_count).to(mine.dtype).reshape(1)
        else:
            recount = torch.zeros(1, dtype=mine.dtype, device=mine.device)
        checks = [recount]
        if verdicts is not None:
            checks.append(verdicts.sums(mine.device).to(mine.dtype))
        everything = torch.cat([mine, *checks])
        if self.layout.world_size > 1:
            dist.all_reduce(everything)
        value, count, router = everything[0], everything[1], everything[2]
        counted = count != 0
        main = torch.where(counted, value / torch.where(counted, count, 1), 0)  # 0 when nothing counts, never NaN
        self._terms = torch.stack([main, router]).float()
        self.late.hold_and_judge_previous(everything[3:], functools.partial(_judge, verdicts))
        return (main + router).float()

    @property
    def terms(self) -> dict[str, float]:
        """The last step's or evaluation's loss by part (reading them is a host sync)."""
        if self._terms is None:
            return {}
        return dict(zip(self.term_tensors, self._terms.tolist()))

    @property
    def term_tensors(self) -> dict[str, torch.Tensor]:
        """`terms` as 0-dim tensors on the compute device, unread."""
        if self._terms is None:
            return {}
        main, router = self._terms.unbind()
        return {"loss_fn": main, "router_aux": router} if self.router_aux is not None else {"loss_fn": main}


def _judge(verdicts: StepVerdicts | None, flags: list[float]) -> None:
    """Raise, on every rank alike, where a call's late flags (summed over the world) say it was faulty."""
    mismatches, *refused = flags
    if verdicts is not None:
        verdicts.judge(refused)
    if mismatches:
        raise ValueError(
            "loss_fn returned counts during the step that differ from those it gave before the step on the "
            "same targets; a (loss_sum, count) loss's count must depend on the target only (found at the end "
            "of the call after that step: the step's update has happened)"
        )
