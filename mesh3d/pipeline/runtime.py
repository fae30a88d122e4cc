"""The interpreter: runs one rank's lowered action list on real tensors.

Per step it splits the batch into microbatches and hands each action of this rank's list, in
order, to the step's `StageCompute` (stage_compute.py: F, B, I, W, recompute; RECV and SEND go to
its mailbox, p2p.py, which posts each receive where the lowering put it and hands tensors
between stages of this rank in memory). Under a never-drain schedule each training step is one
call (never_drain_calls.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from mesh3d.distributed.host_to_device import to_device
from mesh3d.model.stage_inputs import stage_input_names
from mesh3d.pipeline.activation_checkpoint import ActivationCheckpointing
from mesh3d.pipeline.boundary import Boundaries, BoundaryShapes
from mesh3d.pipeline.never_drain_calls import NeverDrainCalls
from mesh3d.pipeline.p2p import Mailbox, PipelinePeers
from mesh3d.pipeline.routes import MessageSpec, StageRoutes
from mesh3d.pipeline.schedule.ir import RELEASES
from mesh3d.pipeline.schedule.lower import LoweredSchedule
from mesh3d.pipeline.schedule.never_drain import NeverDrainStream
from mesh3d.pipeline.stage_compute import CALL_CONTEXT, LocalStages, MicrobatchLoss, RuntimeCounters, StageCompute
from mesh3d.pipeline.weight_versions import WeightVersions


class PipelineRuntime:
    """Executes a lowered schedule for one pp rank.

    Args:
        stages: this rank's stage modules, by stage index.
        meta_stages: every stage of the model on the meta device, used to learn boundary shapes.
        training: the lowered schedule of a training step (every rank's list; this runtime runs
            `peers.pp_rank`'s).
        evaluation: the same schedule's forwards only, lowered (pipeline/config.py lowers both).
        peers: this rank's pp group.
        activation_checkpoint: "never", "always", "except_last" (the last microbatch is kept) or
            "selective" (every microbatch keeps its matmul and attention outputs and recomputes
            the rest): activation_checkpoint.py.
        before_backward: called as before_backward(stage, is_last_backward_of_stage) before every
            backward; data parallelism uses it to reduce gradients once, on the last one.
        after_weight_backward: called as after_weight_backward(stage) after a W that started
            inside the graph (backward_halves.py), where data parallelism's autograd hooks do not
            reach.
        fake_shape_run: for stages whose forward reads values: where the meta run raises, learn
            the boundary shapes again under FakeTensorMode (boundary.py).
        routes: which outputs each stage sends to which stage (routes.py); default: one tensor
            from each stage to the next. The lowered schedules must carry the same skips.
        blocks: a stage's repeated blocks (the anatomy's `blocks`), checkpointed one by one;
            None: every stage is checkpointed whole.
        stream: a never-drain schedule's calls (schedule/never_drain.py): each `run` is then one
            call, whose backwards may finish in the next call or at `flush`; `training` is its
            one-call form (never_drain_calls.py). Needs `versions`, which swaps weight versions and
            runs the updates.

    Activation checkpointing: activation_checkpoint.py's ActivationCheckpointing.

    Stages may be tensor-parallel: what crosses a stage boundary is then the local shard of the
    activation (with sequence parallel, 1/tp of it), and the meta stages carry the same plan, so
    the shapes learned from them are local shapes.
    """

    def __init__(
        self,
        stages: dict[int, nn.Module],
        meta_stages: list[nn.Module],
        training: LoweredSchedule,
        evaluation: LoweredSchedule,
        peers: PipelinePeers,
        activation_checkpoint: str = "never",
        before_backward: Callable[[int, bool], None] | None = None,
        after_weight_backward: Callable[[int], None] | None = None,
        fake_shape_run: bool = False,
        routes: StageRoutes | None = None,
        blocks: Callable[[nn.Module], list[nn.Module]] | None = None,
        stream: NeverDrainStream | None = None,
        versions: WeightVersions | None = None,
    ):
        self.stages = stages
        self.routes = routes if routes is not None else StageRoutes.chain(len(meta_stages))
        if self.routes.skips != training.skips or self.routes.skips != evaluation.skips:
            raise ValueError(
                f"the schedules were lowered with skips {training.skips}, the routes have {self.routes.skips}"
            )
        # the per-sample inputs each stage takes (model/stage_inputs.py), read from the unwrapped meta stages
        self.takes = [stage_input_names(stage) for stage in meta_stages]
        self.boundaries = BoundaryShapes(meta_stages, fake=fake_shape_run, routes=self.routes, takes=self.takes)
        self.peers = peers
        self.device = peers.device
        self.schedule = training.schedule
        self.n_stages = self.schedule.n_stages
        self.microbatches = self.schedule.microbatches
        self.train_actions = training.actions[peers.pp_rank]
        self.eval_actions = evaluation.actions[peers.pp_rank]
        self.counters = RuntimeCounters()  # of the last training step
        last_backward = {}  # per stage, its last action that finishes weight gradients (B, or W)
        for index, action in enumerate(self.train_actions):
            if action.kind in RELEASES:
                last_backward[action.stage] = index
        self._last_backward_index = set(last_backward.values())
        self.checkpointing = ActivationCheckpointing(
            activation_checkpoint, stages, blocks, self.schedule.splits_backward, self.microbatches
        )
        self.local = LocalStages(
            stages,
            self.n_stages,
            self.microbatches,
            self.routes,
            self.device,
            self.checkpointing,
            self.takes,
            before_backward,
            after_weight_backward,
        )
        self.never_drain = NeverDrainCalls(stream, versions, peers.pp_rank, stages) if stream is not None else None

    def check(self, inputs: torch.Tensor, per_sample: dict[str, torch.Tensor] | None = None) -> Boundaries:
        """Everything about the stages that can fail before the first message, on every rank;
        returns the boundary shapes, the model's output on meta among them, for the step to hand
        on. Call once per step, before `run`: it runs the stages on meta tensors (once per input
        shape). `per_sample`: the step's other inputs by name (checked by the step), each handed
        to the stages that take it; one that no stage takes is refused."""
        per_sample = per_sample or {}
        self.check_names(per_sample)
        if torch.is_autocast_enabled(self.device.type):
            raise ValueError(
                "pm.step/evaluate ran under torch.autocast, which mesh3d does not support yet: stage-boundary "
                "dtypes are fixed before the step from a meta run, which autocast does not change. Use "
                "mesh3d.parallelize(..., param_dtype=torch.bfloat16) for mixed precision instead"
            )
        m = self.microbatches
        rows = len(inputs) // m
        return self.boundaries.of(inputs[:rows], {name: t[:rows] for name, t in per_sample.items()})

    def check_names(self, per_sample: dict[str, object]) -> None:
        """Refuse a per-sample input no stage takes (the same on every rank: every rank knows every stage)."""
        taken = set().union(*self.takes)
        unknown = sorted(set(per_sample) - taken)
        if unknown:
            raise ValueError(
                f"per-sample input(s) {unknown} were given, but no pipeline stage takes them (the stages take "
                f"{sorted(taken) or 'none'}); a stage takes an input through a keyword-only parameter of its "
                "forward or its per_sample_inputs (docs/model_protocol.md): leave them out, or add them to the model"
            )

    def run(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor | None,
        boundaries: Boundaries,
        loss: MicrobatchLoss,
        *,
        train: bool,
        per_sample: dict[str, torch.Tensor] | None = None,
        around: Callable[[int], AbstractContextManager] | None = None,
    ) -> torch.Tensor:
        """Run every microbatch through this rank's actions (after `check`, which gave `boundaries`);
        each stage is handed the microbatch's slice of the `per_sample` inputs it takes, and runs
        microbatch mb (forward and recompute) inside `around(mb)` when given (context parallelism's
        attention).

        Returns [sum of the loss values, sum of their counts] computed here (a mean loss counts 1
        per microbatch; zeros on ranks without the last stage)."""
        m = self.microbatches
        input_chunks = to_device(inputs, self.device).chunk(m)
        target_chunks = to_device(targets, self.device).chunk(m) if targets is not None else None
        extra_chunks = _per_microbatch(per_sample or {}, m, self.device)
        if around is not None:
            for mb, extra in enumerate(extra_chunks):
                extra[CALL_CONTEXT] = around(mb)
        never_drain = self.never_drain
        if never_drain is not None and train:
            counters = self.counters = RuntimeCounters()
            start = functools.partial(
                self._start,
                boundaries.specs,
                {},
                {},
                loss,
                True,
                RuntimeCounters(),
                versions=never_drain.versions,
            )
            return never_drain.call(input_chunks, target_chunks, boundaries.specs, loss, counters, start, extra_chunks)
        if never_drain is not None and never_drain.in_flight is not None:
            raise RuntimeError("a never-drain schedule still has backwards in flight: flush() before an evaluation")
        counters = RuntimeCounters()
        if train:
            self.counters = counters  # an evaluation does not replace the last step's figures
        step = self._start(boundaries.specs, input_chunks, target_chunks, loss, train, counters)
        step.per_sample = extra_chunks
        actions = self.train_actions if train else self.eval_actions
        for index, action in enumerate(actions):
            step.execute(action, is_last_backward=index in self._last_backward_index)
        return step.finish()

    def _start(
        self,
        specs: dict[tuple[int, int], MessageSpec],
        inputs,
        targets,
        loss: MicrobatchLoss,
        train: bool,
        counters: RuntimeCounters,
        versions: WeightVersions | None = None,
    ) -> StageCompute:
        """A step's shared state, its mailbox sized for `specs` (boundary shapes)."""
        wire = {pair: spec.wire for pair, spec in specs.items()}
        mailbox = Mailbox(self.peers, self.schedule, wire, counters)
        return StageCompute(self.local, inputs, targets, mailbox, loss, train, counters, specs, versions)

    def flush(self) -> None:
        """Never-drain schedules: finish every backward and update still in flight, then put each
        stage's newest weights in its parameters. Nothing to do for the other schedules."""
        if self.never_drain is not None:
            self.never_drain.flush()


def _per_microbatch(per_sample: dict[str, torch.Tensor], m: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """{name: tensor} split along dim 0 into m microbatches, as the tokens are: [{name: chunk}, ...]."""
    chunks = {name: to_device(t, device).chunk(m) for name, t in per_sample.items()}
    return [{name: parts[mb] for name, parts in chunks.items()} for mb in range(m)]
