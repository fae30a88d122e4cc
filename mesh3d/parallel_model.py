"""ParallelModel: this rank's part of a parallelized model, and the calls a training loop makes on it."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from mesh3d.agree import gather_or_raise
from mesh3d.data_parallel import GradientSync
from mesh3d.grad_norm import clip_grad_norm_
from mesh3d.loss import MEAN, PAIR, LossScale, probe_counts
from mesh3d.mesh import Layout
from mesh3d.pipeline.boundary import Boundaries
from mesh3d.pipeline.runtime import PipelineRuntime
from mesh3d.pipeline.tied import TiedWeights
from mesh3d.state import StateMap
from mesh3d.tensor import TensorParallelConfig, check_loss_parallel_output, settle_gradients


class ParallelModel:
    """What `mesh3d.parallelize` returns: the stages this rank owns, wired into a pipeline schedule.

    Parameter names are always those of the unsplit model. Build an optimizer over
    `pm.parameters()`; call `pm.step(inputs, targets)` for a whole pipelined forward and backward.
    Under tensor or data parallelism the parameters are DTensors (this rank's shards); each
    data-parallel rank passes its own share of the global batch, every tp rank of one replica the
    same share.

    Args:
        layout: this rank's Layout.
        runtime: the pipeline runtime over this rank's stages (it holds the schedule).
        tied: the tied weights across stages.
        state: the whole-model state map.
        stage_layers: the layer range of every stage, in stage order.
        tensor_parallel: the resolved tensor-parallel configuration.
        grad_sync: the once-per-step dp gradient reduction; None when dp == 1.
    """

    def __init__(
        self,
        layout: Layout,
        runtime: PipelineRuntime,
        tied: TiedWeights,
        state: StateMap,
        stage_layers: list[range],
        tensor_parallel: TensorParallelConfig,
        grad_sync: GradientSync | None = None,
    ):
        self.layout = layout
        self.runtime = runtime
        self.stages = runtime.stages
        self.schedule = runtime.schedule
        self.tied = tied
        self.state = state
        self.stage_layers = stage_layers
        self.tensor_parallel = tensor_parallel
        self.grad_sync = grad_sync

    # -- running ------------------------------------------------------------------------------

    def _check(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> tuple[Boundaries, str | None]:
        """Every check of a step or evaluation, on every rank, before any message; the boundary
        shapes and the loss's kind as the meta run saw it."""
        m = self.schedule.microbatches
        if inputs.dim() == 0 or inputs.shape[0] % m != 0:
            raise ValueError(
                f"a batch of {inputs.shape[0] if inputs.dim() else 0} samples does not split into "
                f"microbatches={m} equal microbatches (dim 0); use a batch size that is a multiple of {m}"
            )
        if targets is not None and targets.shape[0] != inputs.shape[0]:
            raise ValueError(f"inputs have {inputs.shape[0]} samples but targets have {targets.shape[0]}")
        tp = self.layout.tp
        if self.tensor_parallel.sequence_parallel and (inputs.dim() < 2 or inputs.shape[1] % tp != 0):
            raise ValueError(
                f"sequence length {inputs.shape[1] if inputs.dim() >= 2 else None} is not divisible by tp={tp}; the tp "
                f"plan uses sequence parallel, which splits dim 1 over the tp ranks: use a multiple of {tp}"
            )
        checked = self.runtime.check(inputs, targets)
        if self.tensor_parallel.loss_parallel:
            check_loss_parallel_output(self.runtime.output_placements, self.runtime.output_ndim)
        return checked

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every microbatch; gradients accumulate into `.grad`.

        With a (loss_sum, count) loss (the default cross-entropy is one), gradients equal those of
        one process computing sum(loss_sums) / sum(counts) over the whole global batch (every
        microbatch, the dp ranks' shares together) and calling backward(): the global token mean,
        exact with masked targets. With a mean loss, the mean of the microbatch means. Data-parallel
        gradients are reduced once, on each stage's last backward. Returns that loss, a 0-dim
        tensor with the same value on every rank (0 when nothing is counted).
        """
        boundaries, kind = self._check(inputs, targets)  # fail before tied gradients are set aside
        scale = self._loss_scale(boundaries, kind, targets)
        self.tied.set_aside_grads()
        try:
            totals = self.runtime.run(inputs, targets, boundaries, scale, train=True)
        except BaseException:
            # The step is lost. Drop what data parallelism holds unreduced (zero_grad cannot reach
            # it) and give tied copies back their earlier gradients; .grad may still hold parts of
            # the failed step, so call zero_grad() before the next one.
            self.tied.restore_set_aside()
            if self.grad_sync is not None:
                self.grad_sync.abort()
            raise
        settle_gradients(self.parameters())
        self.tied.sync_grads()
        return self._global_loss(totals, scale)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of a forward pass only (no gradients, modules in eval mode), the same on every
        rank: the global token mean for a (loss_sum, count) loss, else the mean of microbatch means."""
        boundaries, kind = self._check(inputs, targets)
        scale = LossScale(kind, divisor=1.0)  # nothing is backpropagated: only the kind matters
        modes = {m: m.training for stage in self.stages.values() for m in stage.modules()}
        self.eval()
        try:
            return self._global_loss(self.runtime.run(inputs, targets, boundaries, scale, train=False))
        finally:
            for module, training in modes.items():
                module.training = training
            if self.grad_sync is not None:
                self.grad_sync.end_forward_only()  # no backward came to reshard what the forwards gathered

    def train(self, mode: bool = True) -> ParallelModel:
        """Set train/eval mode on every local stage (dropout and the like), as nn.Module.train does."""
        for stage in self.stages.values():
            stage.train(mode)
        return self

    def eval(self) -> ParallelModel:
        return self.train(False)

    def _loss_scale(self, boundaries: Boundaries, kind: str | None, targets: torch.Tensor) -> LossScale:
        """How the last stage scales each microbatch's loss: by 1/m for a mean loss; for a pair loss
        by the global count, learned here from the targets before the first backward.

        A loss with a count(target) method (the default) is counted directly on the last stage's
        ranks, with one all-reduce over dp among them. Any other pair loss, or a loss that could not
        run on meta tensors, is probed on a zero output there, and every rank learns the result or
        the error in one all-gather, so a loss that fails does so everywhere before any message.
        """
        m, rt = self.schedule.microbatches, self.runtime
        if kind == MEAN:
            return LossScale(MEAN, float(m))
        chunks = targets.to(self.layout.device).chunk(m)
        if kind == PAIR and callable(getattr(rt.loss_fn, "count", None)):
            if not rt.has_last_stage:
                return LossScale(PAIR, 0.0)  # never applied here
            local = torch.stack([torch.as_tensor(rt.loss_fn.count(t), device=self.layout.device) for t in chunks])
            both = torch.stack([local.sum(), local.sum()]).long()  # [this rank's, the global] count
            if self.layout.dp > 1:
                dist.all_reduce(both[1:], group=self.layout.group("dp"))
            mine, total = both.tolist()  # the step's one host sync for the count
            return LossScale(PAIR, total / self.layout.dp, mine)
        probed, error = None, None  # (kind, this rank's total count) from the last stage
        if rt.has_last_stage:
            try:
                found_kind, counts = probe_counts(rt.loss_fn, boundaries.output, list(chunks), rt.loss_context)
                probed = (found_kind, sum(counts))
            except Exception as failure:  # noqa: BLE001 - every rank must raise it, not only this one
                error = f"loss_fn failed before the step on the last stage: {type(failure).__name__}: {failure}"
        voices = [v for v in gather_or_raise(probed if self.layout.tp_rank == 0 else None, error) if v is not None]
        if {k for k, _ in voices} == {MEAN}:
            return LossScale(MEAN, float(m))
        if {k for k, _ in voices} != {PAIR}:
            raise ValueError("loss_fn returned a mean on some ranks and a (loss_sum, count) pair on others; "
                             "return the same kind of result for every batch")
        return LossScale(PAIR, sum(c for _, c in voices) / self.layout.dp, probed[1] if probed else 0)

    def _global_loss(self, totals: torch.Tensor, scale: LossScale | None = None) -> torch.Tensor:
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

    @property
    def peak_live_activations(self) -> int:
        """Most stage-microbatch forwards this rank held for their backward during the last step."""
        return self.runtime.counters.peak_live_activations

    # -- parameters ---------------------------------------------------------------------------

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the unsplit model's names (a shared tensor once)."""
        seen: set[int] = set()
        for index in sorted(self.stages):
            for name, param in self.stages[index].named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters; pass them to the optimizer."""
        for _, param in self.named_parameters():
            yield param

    def zero_grad(self, set_to_none: bool = True) -> None:
        for stage in self.stages.values():
            stage.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so the whole model's gradient norm is at most `max_norm`.

        The norm is over every parameter of the unsplit model, each counted once (a tied weight
        too, and a weight replicated over tp or dp ranks), over all of pp, dp and tp, and is the
        same on every rank. Returns the norm before clipping.
        """
        counted = lambda param: not self.tied.is_secondary_copy(param)  # noqa: E731
        return clip_grad_norm_(self.parameters(), max_norm, norm_type, self.layout, counted)

    # -- whole-model state (the state map's) --------------------------------------------------

    @property
    def state_specs(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Global shape and dtype of every state_dict entry of the unsplit model, in its order
        (both names of a tied weight); the same on every rank."""
        return self.state.specs

    def state_owner_pp_rank(self, name: str) -> int:
        """The pp rank whose stages hold state_dict entry `name` (for a tied weight, its first stage's)."""
        return self.state.owner_pp_rank(name)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state_dict entries under the unsplit model's names, as held (DTensor shards
        under tp/dp, sharing storage with the parameters); a name held by two local stages once."""
        return self.state.local()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit model's state_dict (both names of a tied weight), full tensors on CPU, on every rank."""
        return self.state.full_state_dict()

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the unsplit model's state_dict (every rank passes all of it; each keeps its part)."""
        self.state.check_full_state_dict(state_dict)
        self.state.load_by_slice(lambda name, window: state_dict[name][window])
        self.tied.sync_values()

    def __repr__(self) -> str:
        s = self.schedule
        mine = {i: f"layers {r.start}..{r.stop - 1}" for i, r in enumerate(self.stage_layers) if i in self.stages}
        return (
            f"ParallelModel({self.layout!r}, schedule={s.name}, microbatches={s.microbatches}, "
            f"virtual_stages={s.virtual_stages}, stages here={mine})"
        )
