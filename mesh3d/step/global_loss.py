"""The step's loss over the whole global batch: what kind of loss it is, how each microbatch's
loss is scaled before its backward, and the value every rank returns after the step.

The loss contract itself (a mean or a (loss_sum, count) pair, the default loss) is in loss.py.
Here, per step:

1. the kind: from a meta run of the loss on every rank (no communication); a loss that cannot
   run on meta tensors is called once, on the last stage's real targets and a zero output, and
   the verdict or the error reaches every rank through one all-gather. Either way it is found
   once per input shape and remembered;
2. for a pair loss, the global count, before the first backward: the last stage's ranks count
   their targets (the loss's `count(target)`, or the loss called on a zero output) and add the
   counts over dp with one small all-reduce among themselves;
3. after the schedule, one world all-reduce of (sum of loss values, sum of counts) gives every
   rank the global loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mesh3d.distributed.agree import gather_or_raise
from mesh3d.model.loss import MEAN, PAIR, LossScale, check_loss_on_meta, probe_counts, probe_kind
from mesh3d.mesh import Layout
from mesh3d.pipeline.boundary import Boundaries
from mesh3d.pipeline.runtime import PipelineRuntime


class GlobalLoss:
    """The loss side of a ParallelModel's steps (see the module docstring)."""

    def __init__(self, layout: Layout, runtime: PipelineRuntime):
        self.layout = layout
        self.runtime = runtime
        self._kinds: dict[tuple, str] = {}  # by microbatch input and target shapes and dtypes

    def kind(self, boundaries: Boundaries, inputs: torch.Tensor, targets: torch.Tensor) -> str:
        """MEAN or PAIR, the same on every rank; a loss whose result is neither raises on every rank."""
        rt, m = self.runtime, self.runtime.microbatches
        microbatch, target = inputs[: len(inputs) // m], targets[: len(targets) // m]
        key = (tuple(microbatch.shape), microbatch.dtype, tuple(target.shape), target.dtype)
        if key not in self._kinds:
            kind = check_loss_on_meta(rt.loss_fn, boundaries.output, target, rt.loss_context)
            if kind is None:  # cannot run on meta: ask the last stage, which holds the real output's layout
                found, error = None, None
                if rt.has_last_stage:
                    try:
                        found = probe_kind(rt.loss_fn, boundaries.output, target.to(self.layout.device), rt.loss_context)
                    except Exception as failure:  # noqa: BLE001 - every rank must raise it, not only this one
                        error = f"loss_fn failed before the step on the last stage: {type(failure).__name__}: {failure}"
                kinds = {k for k in gather_or_raise(found, error) if k is not None}
                kind = kinds.pop()
            self._kinds[key] = kind
        return self._kinds[key]

    def scale(self, boundaries: Boundaries, kind: str, targets: torch.Tensor) -> LossScale:
        """How the last stage scales each microbatch's loss in a training step: by 1/m for a mean
        loss; for a pair loss by the global count, found here before the first backward."""
        rt, m = self.runtime, self.runtime.microbatches
        if kind == MEAN:
            return LossScale(MEAN, float(m))
        if not rt.has_last_stage:
            return LossScale(PAIR, 0.0)  # never applied here
        chunks = targets.to(self.layout.device).chunk(m)
        local = torch.stack(probe_counts(rt.loss_fn, boundaries.output, chunks, rt.loss_context)).sum()
        both = torch.stack([local, local]).long()  # [this rank's, the global] count
        if self.layout.dp > 1:
            dist.all_reduce(both[1:], group=self.layout.group("dp"))
        mine, total = both.tolist()  # the step's one host sync for the count
        return LossScale(PAIR, total / self.layout.dp, mine)

    def total(self, totals: torch.Tensor, scale: LossScale | None = None) -> torch.Tensor:
        """Every rank's [loss values, counts] summed over the world: the global loss, on every rank.

        Only last-stage ranks at tp rank 0 contribute (the other tp ranks hold the same values).
        A pair loss whose counts during the step differ from those found before it (a count that
        depends on the output) is an error on every rank: the gradients were scaled wrongly.
        """
        mine = totals.detach() if self.layout.tp_rank == 0 else torch.zeros_like(totals)
        recount = scale is not None and scale.kind == PAIR and bool(totals[1] != scale.expected_count)
        everything = torch.cat([mine, torch.tensor([float(recount)], dtype=mine.dtype, device=mine.device)])
        if self.layout.world_size > 1:
            dist.all_reduce(everything)
        value, count, mismatches = everything.tolist()
        if mismatches:
            raise ValueError(
                "loss_fn returned counts during the step that differ from those it gave before the step on the "
                "same targets; a (loss_sum, count) loss's count must depend on the target only"
            )
        return torch.tensor(value / count if count else 0.0, dtype=torch.float32, device=self.layout.device)
