"""PipelinedStep: one training step or evaluation on this rank's pipeline, as ParallelModel's `step`
and `evaluate` run it: every check, on every rank, before any message; the run; and, when a step
fails, what it leaves behind undone."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mesh3d.data_parallel.gradient_sync import GradientSync
from mesh3d.expert_parallel.expert_load import ExpertLoad
from mesh3d.mesh import Layout
from mesh3d.model.loss import PAIR
from mesh3d.pipeline.boundary import Boundaries
from mesh3d.pipeline.runtime import PipelineRuntime
from mesh3d.pipeline.split import named_stage_parameters
from mesh3d.pipeline.tied import TiedWeights
from mesh3d.step.global_loss import GlobalLoss
from mesh3d.step.per_sample_check import check_batch, check_split
from mesh3d.step.sequence_shards import RankBatch, SequenceShards
from mesh3d.tensor.apply import check_loss_parallel_output
from mesh3d.tensor.gradients import settle_gradients
from mesh3d.tensor.plan import TensorParallelConfig


class PipelinedStep:
    """The step's parts (step/) around this rank's pipeline runtime, in the order a step takes them.

    Args, in the order a step uses them:
        runtime: the pipeline runtime over this rank's stages (it holds the schedule).
        layout: this rank's Layout.
        vocab_size: the vocabulary the model declared, or None.
        index_bounds: the per-sample inputs the model declares indices, {name: n}.
        shards: how each step's batch is cut over the cp ranks.
        tensor_parallel: the resolved tensor-parallel configuration.
        global_loss: the step's loss over the global batch.
        expert_load: per-expert token counts, counted during a training step, or None.
        tied: the tied weights across stages.
        grad_sync: the once-per-step dp gradient reduction, or None.
        optimizer: stepped and zeroed after each drained step when given, or None.
    """

    def __init__(
        self,
        runtime: PipelineRuntime,
        layout: Layout,
        vocab_size: int | None,
        index_bounds: dict[str, int],
        shards: SequenceShards,
        tensor_parallel: TensorParallelConfig,
        global_loss: GlobalLoss,
        expert_load: ExpertLoad | None,
        tied: TiedWeights,
        grad_sync: GradientSync | None,
        optimizer: torch.optim.Optimizer | None,
    ):
        self._runtime = runtime
        self._layout = layout
        self._vocab_size = vocab_size
        self._index_bounds = index_bounds
        self._shards = shards
        self._tensor_parallel = tensor_parallel
        self._global_loss = global_loss
        self._expert_load = expert_load
        self._tied = tied
        self._grad_sync = grad_sync
        self._optimizer = optimizer

    def check(
        self, inputs: torch.Tensor, targets: torch.Tensor, per_sample: dict[str, torch.Tensor], during: str
    ) -> tuple[RankBatch, Boundaries, str]:
        """Every check of a step or evaluation, on every rank, before any message; this rank's part
        of the batch (its tokens of each sequence under cp), the boundary shapes and the loss's
        kind (MEAN or PAIR)."""
        layout = self._layout
        self._runtime.check_names(per_sample)  # the same on every rank: no message needed
        vocab, ignore = self._vocab_size, self._global_loss.ignore_index
        first_row = layout.dp_rank * inputs.shape[0] if inputs.dim() else 0  # this rank's rows in the global batch
        check_batch(inputs, targets, per_sample, vocab, ignore, self._index_bounds, during, first_row)
        batch = self._shards.cut(inputs, targets, per_sample)
        tp, sequence_parallel = layout.tp, self._tensor_parallel.sequence_parallel
        check_split(batch.inputs, self._runtime.schedule.microbatches, tp, sequence_parallel, layout.cp)
        boundaries = self._runtime.check(batch.inputs, batch.per_sample)
        if self._tensor_parallel.loss_parallel:
            output = boundaries.output  # the model's output on meta, as tensor parallelism leaves it
            check_loss_parallel_output(tuple(output.placements) if isinstance(output, DTensor) else None, output.ndim)
        kind = self._global_loss.kind(boundaries, batch.inputs, batch.targets)
        if self._shards.active and kind != PAIR:
            raise ValueError(
                f"{during}: context parallelism (cp={layout.cp}) needs a loss_fn that returns (loss_sum, count): "
                "each rank computes the loss of its tokens only, and only sums and counts add up to the whole "
                "sequence's mean exactly; return the pair (the default cross-entropy does), or use cp=1"
            )
        return batch, boundaries, kind

    def train(self, batch: RankBatch, boundaries: Boundaries, kind: str) -> torch.Tensor:
        """Forward and backward of every microbatch of a checked batch; the step's loss."""
        loss = self._global_loss.for_step(boundaries, kind, batch.targets)

        def run():
            with self._expert_load.counting() if self._expert_load is not None else contextlib.nullcontext():
                return self._run(batch, boundaries, loss, train=True)

        never_drain = self._runtime.never_drain
        if (
            never_drain is not None
        ):  # updates inside the pipeline; after a failure, refused until a checkpoint is loaded
            with never_drain.failure_marked(self.drop_partial_state):
                return self._global_loss.total(run(), loss, batch.verdicts)
        self._tied.set_aside_grads()
        try:
            totals = run()
        except BaseException:
            # The step is lost. Drop what data parallelism holds unreduced (zero_grad cannot reach
            # it) and give tied copies back their earlier gradients; .grad may still hold parts of
            # the failed step, so call zero_grad() before the next one.
            self._tied.restore_set_aside()
            if self._grad_sync is not None:
                self._grad_sync.abort()
            raise
        settle_gradients(param for _, param in named_stage_parameters(self._runtime.stages))
        self._tied.sync_grads()
        value = self._global_loss.total(totals, loss, batch.verdicts)
        if self._optimizer is not None:
            self._optimizer.step()
            self._optimizer.zero_grad()
        return value

    def evaluate(self, batch: RankBatch, boundaries: Boundaries, kind: str) -> torch.Tensor:
        """The loss of a forward pass only of a checked batch, modules in eval mode (their modes
        restored after)."""
        loss = self._global_loss.for_evaluation(kind)
        stages: list[nn.Module] = list(self._runtime.stages.values())
        modes = {m: m.training for stage in stages for m in stage.modules()}
        for stage in stages:
            stage.train(False)
        try:
            return self._global_loss.total(self._run(batch, boundaries, loss, train=False), verdicts=batch.verdicts)
        finally:
            for module, training in modes.items():
                module.training = training
            if self._grad_sync is not None:
                self._grad_sync.end_forward_only()  # no backward came to reshard what the forwards gathered

    def _run(self, batch: RankBatch, boundaries: Boundaries, loss, train: bool):
        """The pipeline runtime over every microbatch of this rank's batch; its loss totals."""
        return self._runtime.run(
            batch.inputs,
            batch.targets,
            boundaries,
            loss,
            train=train,
            per_sample=batch.per_sample,
            around=batch.around,
        )

    def judge_late_verdicts(self) -> None:
        """The last call's device checks judged now (late_verdicts.py); a never-drain schedule's
        call that failed them is marked failed, as a call raising inside would be."""
        never_drain = self._runtime.never_drain
        marked = never_drain.failure_marked(self.drop_partial_state) if never_drain is not None else None
        with marked if marked is not None else contextlib.nullcontext():
            self._global_loss.late.judge_now()

    def discard_late_verdicts(self) -> None:
        """Forget the last call's device checks unjudged (its weights are being replaced)."""
        self._global_loss.late.discard()

    def drop_partial_state(self) -> None:
        """What a call that stopped half-way leaves in data parallelism (unreduced gradients,
        gathered parameters) and in `.grad` (the never-drain state drops its own part)."""
        if self._grad_sync is not None:
            self._grad_sync.abort()
        for stage in self._runtime.stages.values():
            stage.zero_grad(set_to_none=True)
