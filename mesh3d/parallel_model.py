"""ParallelModel: this rank's part of a parallelized model, and the calls a training loop makes on it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from mesh3d.data_parallel.gradient_sync import GradientSync
from mesh3d.distributed.peer_timeout import located
from mesh3d.expert_parallel.expert_load import ExpertLoad
from mesh3d.mesh import Layout
from mesh3d.model.state_map import StateMap
from mesh3d.pipeline.never_drain_calls import NeverDrainCalls
from mesh3d.pipeline.runtime import PipelineRuntime, RuntimeCounters
from mesh3d.pipeline.schedule.ir import Schedule
from mesh3d.pipeline.split import named_stage_parameters
from mesh3d.pipeline.tied import TiedWeights
from mesh3d.step.global_loss import GlobalLoss
from mesh3d.step.grad_norm import clip_grad_norm_
from mesh3d.step.pipelined_step import PipelinedStep
from mesh3d.step.sequence_shards import SequenceShards
from mesh3d.tensor.plan import TensorParallelConfig


class ParallelModel:
    """What `mesh3d.parallelize` returns: the stages this rank owns, wired into a pipeline schedule.

    Parameter names are always those of the unsplit model. Build an optimizer over
    `pm.parameters()`; call `pm.step(inputs, targets)` for a whole pipelined forward and backward.
    Under tensor or data parallelism the parameters are DTensors (this rank's shards); each
    data-parallel rank passes its own share of the global batch, every tp rank of one replica the
    same share.

    A peer that does not answer within the layout's timeout (`build_mesh(timeout=)`) makes step,
    evaluate and clip_grad_norm_ raise `mesh3d.PeerTimeout`, naming what waited and this rank's
    mesh coordinates.

    Args:
        layout: this rank's Layout.
        runtime: the pipeline runtime over this rank's stages (it holds the schedule).
        global_loss: the step's loss over the global batch (it holds the loss function).
        tied: the tied weights across stages.
        state: the whole-model state map.
        stage_layers: the layer range of every stage, in stage order.
        tensor_parallel: the resolved tensor-parallel configuration.
        grad_sync: the once-per-step dp gradient reduction; None when the stages are not wrapped
            (dp == 1 without mixed precision or a never-drain schedule).
        vocab_size: the vocabulary the model declared; token ids and targets are checked against it.
        optimizer: the optimizer parallelize built from its `optimizer=` factory, or None.
        index_bounds: the per-sample inputs the model declares indices, {name: n}: each in [0, n).
        sequence_shards: how each step's batch is cut over the cp ranks (None: cp = 1, as given).
        expert_load: per-expert token counts, for a model whose experts are declared.
        before_step: called at the start of every step and evaluate, before any forward (float8's
            weight scales, recomputed after whatever changed the weights since: model/float8.py).

    Its public names are listed in docs/parallelize.md (tests/unit/test_public_names.py holds them).
    """

    def __init__(
        self,
        layout: Layout,
        runtime: PipelineRuntime,
        global_loss: GlobalLoss,
        tied: TiedWeights,
        state: StateMap,
        stage_layers: list[range],
        tensor_parallel: TensorParallelConfig,
        grad_sync: GradientSync | None = None,
        vocab_size: int | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        index_bounds: dict[str, int] | None = None,
        sequence_shards: SequenceShards | None = None,
        expert_load: ExpertLoad | None = None,
        before_step: Callable[[], None] | None = None,
    ):
        self._before_step = before_step
        self._expert_load = expert_load
        self._optimizer = optimizer
        self._layout = layout
        self._runtime = runtime
        self._tied = tied
        self._state = state
        self._stage_layers = stage_layers
        self._grad_sync = grad_sync
        self._global_loss = global_loss  # kind, count and total of the step's loss
        shards = sequence_shards or SequenceShards(layout, runtime.schedule.microbatches, False)
        self._pipelined = PipelinedStep(
            runtime,
            layout,
            vocab_size,
            index_bounds or {},
            shards,
            tensor_parallel,
            global_loss,
            expert_load,
            tied,
            grad_sync,
            optimizer,
        )

    # -- running ------------------------------------------------------------------------------

    @property
    def layout(self) -> Layout:
        """This rank's Layout: its mesh coordinate, groups and device."""
        return self._layout

    @property
    def schedule(self) -> Schedule:
        """The training schedule (its `name`, `pp`, `microbatches`, `virtual_stages`)."""
        return self._runtime.schedule

    @property
    def stages(self) -> dict[int, nn.Module]:
        """{stage index: this rank's stage module}, each under the unsplit model's names."""
        return self._runtime.stages

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer parallelize built over this rank's parameters from `optimizer=` (None if
        none was given): hand it to an LR scheduler, or to mesh3d.checkpoint.save."""
        return self._optimizer

    @property
    def never_drains(self) -> bool:
        """Whether the schedule overlaps calls and updates inside the pipeline ("pipedream",
        "pipedream_2bw"): `step`'s backwards may finish during the next calls; see `flush`."""
        return self._runtime.never_drain is not None

    @property
    def never_drain_state(self) -> NeverDrainCalls | None:
        """A never-drain schedule's state beyond the weights (where its update rule stands, the
        weight versions it keeps), torch's Stateful (`state_dict`/`load_state_dict`): what
        mesh3d.checkpoint saves and loads. None for a schedule that drains."""
        return self._runtime.never_drain

    def flush(self) -> None:
        """Finish every backward and update still in flight (never-drain schedules; nothing to do
        for the others). Call it before reading or saving the weights and at the end of training;
        `evaluate`, `full_state_dict` and the checkpoint functions flush by themselves. A flush changes no update
        rule: the next calls see the weight versions they would have seen without it. It also judges
        the last call's checks that are device values (step/late_verdicts.py), raising on every rank
        where they failed: call it on every rank."""
        with self._peer_failures("pm.flush"), torch.enable_grad():  # backwards, even if called under no_grad
            self._runtime.flush()
        self._pipelined.judge_late_verdicts()  # the last call's device checks: nothing later would judge them

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, **per_sample: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every microbatch; gradients accumulate into `.grad`.

        `per_sample`: other inputs whose first dimension is the batch (position ids, document ids,
        a mask), split into microbatches with the tokens and handed by keyword to every stage whose
        forward takes them (docs/model_protocol.md); never sent between stages. Checked with the
        tokens on every rank: the batch size, and an index's dtype and range.

        Given `optimizer=` at parallelize, the step also updates the weights and zeroes the
        gradients. Under a never-drain schedule ("pipedream", "pipedream_2bw") the updates happen
        inside the pipeline, stage by stage, as the schedule's update rule says
        (docs/pipeline.md#never-drain-schedules); this batch's last backwards may finish during
        the next calls (`flush` finishes them). The loss returned is this batch's, computed with
        the weights the rule gives each microbatch.

        With a (loss_sum, count) loss (the default cross-entropy is one), gradients equal those of
        one process computing sum(loss_sums) / sum(counts) over the whole global batch (every
        microbatch, the dp ranks' shares together) and calling backward(): the global token mean,
        exact with masked targets. With a mean loss, the mean of the microbatch means. Data-parallel
        gradients are reduced once, on each stage's last backward. Returns that loss, a 0-dim
        float32 tensor on the compute device with the same value on every rank (0 when nothing is
        counted), unread: the step waits for no device (its batch is checked on the host copy), and
        reading the loss is the caller's one sync, so read it only when logging. Checks that only
        the device can make (a count that depends on the output, cp's attention calls) raise on
        every rank one call late: at the end of the next step or evaluate, or in `flush`.
        """
        with self._peer_failures("pm.step"):
            # fail before tied gradients are set aside
            batch, boundaries, kind = self._pipelined.check(inputs, targets, per_sample, "pm.step")
            if self._before_step is not None:
                with torch.no_grad():
                    self._before_step()
            return self._pipelined.train(batch, boundaries, kind)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, **per_sample: torch.Tensor) -> torch.Tensor:
        """The loss of a forward pass only (no gradients, modules in eval mode), the same on every
        rank: the global token mean for a (loss_sum, count) loss, else the mean of microbatch means.
        `per_sample` as for `step`.
        Under a never-drain schedule it flushes first (`flush`), so it sees every update in flight."""
        self.flush()
        with self._peer_failures("pm.evaluate"):
            batch, boundaries, kind = self._pipelined.check(inputs, targets, per_sample, "pm.evaluate")
            if self._before_step is not None:
                with torch.no_grad():
                    self._before_step()
            return self._pipelined.evaluate(batch, boundaries, kind)

    def train(self, mode: bool = True) -> ParallelModel:
        """Set train/eval mode on every local stage (dropout and the like), as nn.Module.train does."""
        for stage in self.stages.values():
            stage.train(mode)
        return self

    def eval(self) -> ParallelModel:
        """Eval mode on every local stage (`train(False)`)."""
        return self.train(False)

    @property
    def counters(self) -> RuntimeCounters:
        """What the pipeline runtime counted in the last training step on this rank: messages and
        bytes sent and received, live and peak activations, checkpointed and recomputed forwards."""
        return self._runtime.counters

    @property
    def loss_terms(self) -> dict[str, float]:
        """The last `step`'s or `evaluate`'s loss by part, the same on every rank: {"loss_fn": the
        loss function's (the cross-entropy by default)}, and "router_aux" (coef x the router's
        load-balancing loss, averaged over the microbatches) for a mixture of experts whose config
        asks for it; the loss returned is their sum."""
        return dict(self._global_loss.terms)

    @property
    def loss_term_tensors(self) -> dict[str, torch.Tensor]:
        """`loss_terms` as 0-dim float32 tensors on the compute device, unread: what a loop holds
        until its next logging step, so that the steps between read nothing back."""
        return self._global_loss.term_tensors

    def expert_load(self) -> dict[str, torch.Tensor]:
        """For a mixture of experts: {experts module name: how many tokens the router sent to each of
        its experts in the last training step}, summed over every rank (int64, on CPU, the same on
        every rank); what DeepSeek-V3's bias balancing steers by (mesh3d.train.expert_bias). A
        collective: call it on every rank. Empty for a model without a declared experts module."""
        return self._expert_load.gather() if self._expert_load is not None else {}

    @property
    def peak_live_activations(self) -> int:
        """Most stage-microbatch forwards this rank held for their backward during the last step."""
        return self._runtime.counters.peak_live_activations

    def comm_bytes(self) -> dict[tuple[int, int], int]:
        """{(src_stage, dst_stage): bytes this rank sent to that stage in the last training step}.

        Activations and gradients alike: an activation from stage 1 to stage 2 is key (1, 2), a
        gradient from stage 2 back to stage 1 is key (2, 1). Only messages that left this rank
        count; a hand-over between two stages this rank holds (ZBV's turn, for one) sends nothing
        and has no key. Bytes are those of the tensors as sent: local shards under tensor
        parallelism, param_dtype under mixed precision. An evaluation does not change it."""
        return dict(self._runtime.counters.bytes_by_stage_pair)

    # -- parameters ---------------------------------------------------------------------------

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the unsplit model's names (a shared tensor once)."""
        return named_stage_parameters(self.stages)

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters; pass them to the optimizer."""
        for _, param in self.named_parameters():
            yield param

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop, the default) the gradients of every local stage, as nn.Module.zero_grad does."""
        for stage in self.stages.values():
            stage.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so the whole model's gradient norm is at most `max_norm`.

        The norm is over every parameter of the unsplit model, each counted once (a tied weight
        too, and a weight replicated over tp or dp ranks), over all of pp, dp and tp, and is the
        same on every rank. Returns the norm before clipping.
        """
        if self.never_drains:
            raise ValueError(
                f"pm.clip_grad_norm_ under schedule {self.schedule.name!r}: its updates run inside the pipeline, "
                "stage by "
                "stage, so no whole gradient is ever there to clip by its global norm; train without clipping"
            )
        counted = lambda param: not self._tied.is_secondary_copy(param)  # noqa: E731
        with self._peer_failures("pm.clip_grad_norm_ (the gradient-norm all-reduce)"):
            return clip_grad_norm_(self.parameters(), max_norm, norm_type, self.layout, counted)

    def _peer_failures(self, during: str):
        """A peer that does not answer in time becomes a PeerTimeout naming the wait and this rank's place."""
        layout = self.layout
        return located(layout.rank, layout.coordinate, layout.timeout, during)

    # -- whole-model state (the state map's) --------------------------------------------------

    @property
    def state_map(self) -> StateMap:
        """The unsplit model's state_dict as this rank holds it (model/state_map.py): every entry's
        global shape and dtype (`.specs`), its owner (`.owner_pp_rank(name)`), tied names
        (`.ties`), this rank's entries as held (`.local()`), gathering and loading by slice. What
        mesh3d.checkpoint reads and writes; after writing weights through it, call `weights_replaced`."""
        return self._state

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit model's state_dict (both names of a tied weight), full tensors on CPU, on every
        rank; a never-drain schedule flushes first."""
        self.flush()
        return self._state.full_state_dict()

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the unsplit model's state_dict (every rank passes all of it; each keeps its part).
        Under a never-drain schedule the work in flight is dropped and the update rule starts
        afresh from these weights."""
        self._state.check_full_state_dict(state_dict)
        self.discard_in_flight()
        self._state.load_by_slice(lambda name, window: state_dict[name][window])
        self.weights_replaced()

    def weights_replaced(self) -> None:
        """After weights were written from outside the training loop (through `state_map`, by a
        checkpoint or an import, after `discard_in_flight`): tied copies made equal again (their
        first copy's value) and a never-drain schedule's update rule started afresh from them."""
        self._tied.sync_values()
        if self.never_drains:
            self._runtime.never_drain.restart_rule()

    def discard_in_flight(self) -> None:
        """Before weights are replaced: forget the last call's device checks not yet judged
        (late_verdicts.py: the weights coming in replace what that call did) and, under a
        never-drain schedule, drop what the calls left in flight (backwards not run, gradients not
        applied) and forget an earlier failure. Local to each rank: no message is pending between
        calls. After a failed never-drain call with pp > 1 it raises instead: that call's posted
        receives and sends between the pipeline ranks stay in the process group (neither gloo nor
        NCCL withdraws them) and would take the next run's messages."""
        self._pipelined.discard_late_verdicts()
        if not self.never_drains:
            return
        if self._runtime.never_drain.failed is not None and self.layout.pp > 1:
            raise RuntimeError(
                f"a never-drain {self._runtime.never_drain.failed} with messages in flight between pipeline ranks, "
                "which the process "
                "group cannot withdraw: restart the processes (torchrun restarts them with --max-restarts) and resume "
                "from the checkpoint there"
            )
        self._pipelined.drop_partial_state()
        self._runtime.never_drain.discard_in_flight()

    def __repr__(self) -> str:
        s = self.schedule
        mine = {
            i: f"layers {r.start}..{r.stop - 1}" if len(r) else "an end alone"
            for i, r in enumerate(self._stage_layers)
            if i in self.stages
        }
        return (
            f"ParallelModel({self.layout!r}, schedule={s.name}, microbatches={s.microbatches}, "
            f"virtual_stages={s.virtual_stages}, stages here={mine})"
        )
