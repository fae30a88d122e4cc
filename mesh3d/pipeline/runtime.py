"""The interpreter: runs one rank's lowered action list on real tensors.

Per step it splits the batch into microbatches, and for each action: F runs a stage (the last
stage adds the loss the step hands it, already scaled: by 1/m, or by the global count) and
keeps what its backward needs (under activation checkpointing: per block, or the whole stage
under a split backward; see PipelineRuntime); B runs the stage's
backward with the received output gradient; RECV and SEND go to the step's mailbox (p2p.py),
which posts receives early and hands tensors between stages of this rank in memory.

A stage may take messages from several producers and send to several consumers (routes.py:
several tensors per boundary, skip connections straight to their consumer). What a stage received
is joined into one leaf and what it sends into one output, so each backward (B, or I then W)
runs from one output to one input as for a chain of stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mesh3d.pipeline.boundary import Boundaries, BoundaryShapes
from mesh3d.pipeline.schedule.lower import LoweredSchedule
from mesh3d.pipeline.p2p import Mailbox, PipelinePeers, ReceiveBuffers, Traffic
from mesh3d.pipeline.routes import MessageSpec, StageRoutes, divide, join, pack, unpack
from mesh3d.pipeline.schedule.ir import RELEASES, Action, Kind
from mesh3d.pipeline.backward_halves import PendingWeightGrad, backward_input, backward_weight
from mesh3d.pipeline.activation_checkpoint import FULL, SELECTIVE, BlockCheckpointSwitch, checkpoint_blocks, selective_contexts
from mesh3d.pipeline.schedule.never_drain import NeverDrainStream
from mesh3d.pipeline.weight_versions import WeightVersions


class MicrobatchLoss(Protocol):
    """The last stage's loss for one step or evaluation, handed to `run` by the step
    (step/global_loss.py builds it from the user's loss_fn and the step's scale)."""

    def __call__(self, output: torch.Tensor, target: torch.Tensor, microbatch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss value to report, the count it stands for, the scaled tensor to backpropagate) of
        the step's `microbatch`-th microbatch."""

    def context(self) -> AbstractContextManager:
        """The context the loss's backward runs in (tensor parallelism's loss_parallel)."""


@dataclass
class RuntimeCounters(Traffic):
    """What the last training step did on this rank (reset at the start of every step)."""

    live_activations: int = 0  # stage-microbatch forwards held for their backward, right now
    peak_live_activations: int = 0
    recomputed_forwards: int = 0  # stage-microbatch forwards run under activation checkpointing
    checkpointed_blocks: int = 0  # of their block forwards, those checkpointed (and recomputed) one by one


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
            the rest: activation_checkpoint.py).
        before_backward: called as before_backward(stage, is_last_backward_of_stage) before every
            backward; data parallelism uses it to reduce gradients once, on the last one.
        after_weight_backward: called as after_weight_backward(stage) after a W that started
            inside the graph (backward_halves.py), where data parallelism's autograd hooks do not
            reach.
        fake_shape_run: learn the boundary shapes under FakeTensorMode (boundary.py), for stages
            whose forward reads values.
        routes: which outputs each stage sends to which stage (routes.py); default: one tensor
            from each stage to the next. The lowered schedules must carry the same skips.
        blocks: a stage's repeated blocks (the anatomy's `blocks`), checkpointed one by one
            (below); None: every stage is checkpointed whole.
        stream: a never-drain schedule's calls (schedule/never_drain.py): each `run` is then one
            call, whose backwards may finish in the next call or at `flush`; `training` is its
            one-call form. Needs `versions`, which swaps weight versions and runs the updates.

    What activation checkpointing checkpoints:
    - schedules with a whole backward (gpipe, 1f1b, interleaved_1f1b): each block of a stage on
      its own (activation_checkpoint.py), inside the block's FSDP/DDP unit; the stage's ends
      (embedding, head, loss) keep their activations. A block keeps its inputs ("selective": and
      its matmul and attention results), and torch recomputes it inside B's backward, one block
      at a time. A stage without blocks is checkpointed whole: recomputed by torch inside B
      ("always", "except_last"), or, under "selective", as under a split backward (below).
    - split-backward schedules (zero_bubble, zbv): the whole stage, recomputed by this runtime
      just before I as a plain forward whose graph serves I and W ("selective": with the cached
      results). torch's checkpoint recomputes once per backward pass, and I and W are two passes
      over one graph: per block, W would recompute every block again (and find a selective cache
      already spent).

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
        self.stream = stream
        self.versions = versions
        self.in_flight: _InFlight | None = None  # never-drain: the calls whose backwards are not all done
        self.calls = 0  # never-drain: calls run so far (microbatches are numbered across them)
        self.last_call_behind = False  # whether the last call ran behind another still in flight
        self.failed: str | None = None  # never-drain: a call that raised half-way (what it was)
        self.routes = routes if routes is not None else StageRoutes.chain(len(meta_stages))
        if self.routes.skips != training.skips or self.routes.skips != evaluation.skips:
            raise ValueError(f"the schedules were lowered with skips {training.skips}, the routes have {self.routes.skips}")
        self.boundaries = BoundaryShapes(meta_stages, fake=fake_shape_run, routes=self.routes)
        self.peers = peers
        self.device = peers.device
        self.activation_checkpoint = activation_checkpoint
        self.before_backward = before_backward
        self.after_weight_backward = after_weight_backward
        self.schedule = training.schedule
        self.n_stages = self.schedule.n_stages
        self.microbatches = self.schedule.microbatches
        self.train_actions = training.actions[peers.pp_rank]
        self.eval_actions = evaluation.actions[peers.pp_rank]
        self.counters = RuntimeCounters()  # of the last training step
        self.receive_buffers = ReceiveBuffers()  # kept between steps on CPU (p2p.py)
        last_backward = {}  # per stage, its last action that finishes weight gradients (B, or W)
        for index, action in enumerate(self.train_actions):
            if action.kind in RELEASES:
                last_backward[action.stage] = index
        self._last_backward_index = set(last_backward.values())
        # Split backward (I then W): activation checkpointing recomputes the forward once, at I,
        # and the graph it builds serves both halves (torch's checkpoint would recompute per pass).
        self.split_backward = self.schedule.splits_backward
        # The stages whose blocks checkpoint themselves, each while the switch is on (forward).
        self.block_switch = BlockCheckpointSwitch()
        self.per_block_stages: set[int] = set()
        if activation_checkpoint != "never" and blocks is not None and not self.split_backward:
            for index, stage_module in stages.items():
                stage_blocks = blocks(stage_module)
                if stage_blocks:
                    checkpoint_blocks(stage_blocks, self.block_switch)
                    self.per_block_stages.add(index)

    def check(self, inputs: torch.Tensor) -> Boundaries:
        """Everything about the stages that can fail before the first message, on every rank;
        returns the boundary shapes, the model's output on meta among them, for the step to hand
        on. Call once per step, before `run`: it runs the stages on meta tensors (once per input
        shape)."""
        if torch.is_autocast_enabled(self.device.type):
            raise ValueError(
                "pm.step/evaluate ran under torch.autocast, which mesh3d does not support yet: stage-boundary "
                "dtypes are fixed before the step from a meta run, which autocast does not change. Use "
                "mesh3d.parallelize(..., param_dtype=torch.bfloat16) for mixed precision instead"
            )
        m = self.microbatches
        microbatch = inputs[: len(inputs) // m]
        return self.boundaries.of(microbatch)

    def run(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor | None,
        boundaries: Boundaries,
        loss: MicrobatchLoss,
        *,
        train: bool,
    ) -> torch.Tensor:
        """Run every microbatch through this rank's actions (after `check`, which gave `boundaries`).

        Returns [sum of the loss values, sum of their counts] computed here (a mean loss counts 1
        per microbatch; zeros on ranks without the last stage)."""
        m = self.microbatches
        if self.stream is not None and train:
            return self._run_call(inputs, targets, boundaries, loss)
        if self.in_flight is not None:
            raise RuntimeError("a never-drain schedule still has backwards in flight: flush() before an evaluation")
        input_chunks = inputs.to(self.device).chunk(m)
        target_chunks = targets.to(self.device).chunk(m) if targets is not None else None
        counters = RuntimeCounters()
        if train:
            self.counters = counters  # an evaluation does not replace the last step's figures
        wire = {pair: spec.wire for pair, spec in boundaries.specs.items()}
        mailbox = Mailbox(self.peers, self.schedule, wire, counters, self.receive_buffers)
        step = _InFlight(self, input_chunks, target_chunks, mailbox, loss, train, counters, boundaries.specs)
        actions = self.train_actions if train else self.eval_actions
        mailbox.post_receives_ahead(actions)
        for index, action in enumerate(actions):
            step.execute(action, is_last_backward=index in self._last_backward_index)
        return step.finish()

    def _run_call(self, inputs: torch.Tensor, targets: torch.Tensor, boundaries: Boundaries,
                  loss: MicrobatchLoss) -> torch.Tensor:
        """One call of a never-drain schedule: this batch's forwards, the backwards the stream puts
        in this call (some of the previous call's), and the updates they complete."""
        m = self.microbatches
        self._refuse_after_failure()
        if self.in_flight is not None and self.in_flight.specs != boundaries.specs:
            self.flush()  # new boundary shapes: the messages in flight were sized for the old ones
        behind = self.in_flight is not None
        if not behind:
            wire = {pair: spec.wire for pair, spec in boundaries.specs.items()}
            mailbox = Mailbox(self.peers, self.schedule, wire, RuntimeCounters(), self.receive_buffers, window=2 * m)
            self.in_flight = _InFlight(self, {}, {}, mailbox, loss, True, RuntimeCounters(), boundaries.specs)
        step = self.in_flight
        counters = self.counters = RuntimeCounters()
        first = self.calls * m
        step.begin_call(dict(enumerate(inputs.to(self.device).chunk(m), first)),
                        dict(enumerate(targets.to(self.device).chunk(m), first)), loss, counters)
        self.versions.begin_call(self.calls)
        actions = self.stream.call(self.peers.pp_rank, self.calls, behind)
        self.calls += 1
        self.last_call_behind = behind
        return self._execute_call(step, actions, f"call {self.calls - 1}")

    def _execute_call(self, step: _InFlight, actions: tuple[Action, ...], what: str) -> torch.Tensor:
        try:
            step.mailbox.post_receives_ahead(actions)
            for action in actions:
                step.execute(action, is_last_backward=False)  # a never-drain step asks its update rule
            return step.end_call()
        except BaseException as error:
            self.mark_failed(f"{what} raised {type(error).__name__}")
            raise

    def mark_failed(self, what: str) -> None:
        """A never-drain call (or its closing loss) raised: part of its updates ran, and the weight
        versions and the work in flight are out of step with the rule; nothing can continue it
        exactly but a checkpoint (`discard_in_flight` once one is loaded)."""
        self.in_flight = None
        self.failed = self.failed or what

    def _refuse_after_failure(self) -> None:
        if self.failed is not None:
            raise RuntimeError(
                f"a never-drain {self.failed} half-way through the pipeline: the weights, their kept versions and "
                "the updates in flight no longer follow the update rule; load a checkpoint (mesh3d.checkpoint.load) "
                "to continue (with pp > 1: restart the processes and resume from one)"
            )

    def discard_in_flight(self) -> None:
        """Before weights are replaced (a checkpoint, a state dict): the runtime's part of what the
        calls left in flight is dropped, and any earlier failure forgotten. No message is pending
        between calls (each call receives everything it sends), so this needs no communication;
        ParallelModel.discard_in_flight drops data parallelism's part (and refuses after a failure
        with pipeline ranks: the messages the failed call left posted cannot be withdrawn)."""
        self.in_flight, self.failed, self.last_call_behind = None, None, False

    def restart_rule(self) -> None:
        """After weights were replaced from outside the rule (a full state dict, safetensors, a
        checkpoint of a schedule that drains): the update rule starts afresh from them, as at the
        first call (their one version is all there is)."""
        if self.versions is None:
            return
        self.discard_in_flight()
        self.calls = 0
        self.versions.restore(0, 0, {})

    def flush(self) -> None:
        """Never-drain schedules: finish every backward and update still in flight, then put each
        stage's newest weights in its parameters. Nothing to do for the other schedules."""
        if self.stream is None:
            return
        self._refuse_after_failure()
        if self.in_flight is not None:
            step, self.in_flight = self.in_flight, None
            step.counters = self.counters  # the flush's traffic counts to the last call
            step.mailbox.traffic = self.counters
            self._execute_call(step, self.stream.flush(self.peers.pp_rank, self.calls - 1, self.last_call_behind),
                               "flush")
        self.versions.settle()


class _InFlight:
    """What the actions of a step share while it runs: the mailbox, what backwards need, losses.
    Under a never-drain schedule one lives from the first call to the flush, carrying the
    backwards and messages a call leaves to the next."""

    def __init__(self, runtime: PipelineRuntime, input_chunks, target_chunks, mailbox: Mailbox, loss: MicrobatchLoss,
                 train: bool, counters: RuntimeCounters, specs: dict[tuple[int, int], MessageSpec]):
        self.rt = runtime
        self.routes = runtime.routes
        self.specs = specs
        self.counters = counters
        self.inputs = input_chunks
        self.targets = target_chunks
        self.mailbox = mailbox
        self.loss = loss
        self.train = train
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # from I, for its W: a PendingWeightGrad, or (output, output gradient) for a whole backward
        self.pending_weight_grads: dict[tuple[int, int], PendingWeightGrad | tuple] = {}
        self.rng_states: dict[tuple[int, int], tuple] = {}  # forwards to recompute before their backward
        self.selective_caches: dict[tuple[int, int], AbstractContextManager] = {}  # their cached results ("selective")
        self.losses: list[torch.Tensor] = []
        self.counts: list[torch.Tensor] = []

    def begin_call(self, inputs: dict[int, torch.Tensor], targets: dict[int, torch.Tensor], loss: MicrobatchLoss,
                   counters: RuntimeCounters) -> None:
        """A never-drain schedule's next call on this same state: its batch's microbatches (numbered
        across calls), its loss, its counters. What the previous call left in flight stays."""
        self.inputs, self.targets, self.loss = inputs, targets, loss
        self.counters = self.mailbox.traffic = counters
        counters.live_activations = len(self.saved)
        counters.peak_live_activations = len(self.saved)

    def end_call(self) -> torch.Tensor:
        """The end of a never-drain call: its sends done, its losses summed (as `finish`)."""
        totals = self.finish()
        self.losses, self.counts = [], []
        return totals

    def execute(self, action: Action, is_last_backward: bool) -> None:
        kind = action.kind
        # An evaluation runs after a flush, on the newest weights the parameters hold: no update
        # rule applies to its microbatches (numbered from 0, they would ask for long-gone versions).
        versions = self.rt.versions if self.train else None
        if versions is not None and kind in (Kind.F, Kind.B):
            versions.before_compute(action.stage, action.microbatch)
            is_last_backward = versions.rule.completes_update(action.microbatch)
        if kind == Kind.F:
            self.forward(action.stage, action.microbatch)
        elif kind == Kind.B:
            self.backward(action.stage, action.microbatch, is_last_backward)
            if versions is not None:
                versions.after_backward(action.stage, action.microbatch)
        elif kind == Kind.U:
            versions.update(action.stage, action.microbatch)
        elif kind == Kind.TIE:
            versions.tie(action.stage, action.microbatch)
        elif kind == Kind.I:
            self.backward_input(action.stage, action.microbatch)
        elif kind == Kind.W:
            self.backward_weight(action.stage, action.microbatch, is_last_backward)
        elif kind in (Kind.RECV_F, Kind.RECV_B):
            self.mailbox.post_recv(action)
        else:
            self.mailbox.send(action)

    def _received(self, stage: int, mb: int) -> torch.Tensor:
        """What `stage` takes for microbatch `mb`: the batch's, or its producers' messages joined."""
        if stage == 0:
            return self.inputs[mb]
        return join([self.mailbox.take(Kind.F, stage, p, mb) for p in self.routes.producers(stage)])

    def _call(self, stage: int, x: torch.Tensor):
        """The stage on its inputs: the components of the joined messages, in the routes' order."""
        if stage == 0:
            return self.rt.stages[0](x)
        producers = self.routes.producers(stage)
        messages = divide(x, [self.specs[(p, stage)] for p in producers])
        inputs = [t for p, message in zip(producers, messages) for t in unpack(message, self.specs[(p, stage)])]
        return self.rt.stages[stage](*inputs)

    def _messages(self, stage: int, out) -> list[torch.Tensor]:
        """A stage's outputs packed into one message per consumer, in the routes' order."""
        outputs = out if isinstance(out, tuple) else (out,)
        return [pack([outputs[k] for k in self.routes.takes[(stage, c)]]) for c in self.routes.consumers(stage)]

    def _send_input_grad(self, stage: int, mb: int, grad: torch.Tensor) -> None:
        """The gradient of what `stage` received, divided back into its producers' messages."""
        producers = self.routes.producers(stage)
        for p, part in zip(producers, divide(grad, [self.specs[(p, stage)] for p in producers])):
            self.mailbox.put(Kind.B, stage, p, mb, part)

    def _output_grad(self, stage: int, mb: int) -> torch.Tensor | None:
        """The gradients of what `stage` sent, joined as its output was (None on the last stage)."""
        if stage == self.rt.n_stages - 1:
            return None
        return join([self.mailbox.take(Kind.B, stage, c, mb) for c in self.routes.consumers(stage)])

    def forward(self, stage: int, mb: int) -> None:
        rt, last = self.rt, stage == self.rt.n_stages - 1
        x = self._received(stage, mb)
        if self.train and stage > 0 and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        mode = rt.activation_checkpoint
        recompute = self.train and (
            mode in ("always", "selective") or (mode == "except_last" and mb % rt.microbatches != rt.microbatches - 1)
        )
        if recompute:
            self.counters.recomputed_forwards += 1
        # Where the forward is recomputed: by torch's checkpoint inside B's backward pass (per
        # block, or the whole stage when it has no blocks), or by this runtime just before the
        # backward, as a plain forward building the graph the backward then walks: for a split
        # backward (I and W share that graph), and under "selective" for a stage without blocks
        # (see _forward_caching).
        per_block = recompute and stage in rt.per_block_stages
        recompute_before_backward = recompute and not per_block and (rt.split_backward or mode == "selective")
        if recompute_before_backward:
            self.rng_states[(stage, mb)] = _rng_state(rt.device)
        # Under "selective" the forward runs with grad enabled, as its recompute will: a composite
        # op may pick its kernels by requires_grad, and the cache is read back by op and position.
        grad_at_forward = self.train and (not recompute_before_backward or mode == "selective")
        messages = []
        with torch.set_grad_enabled(grad_at_forward):
            if per_block:
                before = rt.block_switch.checkpointed
                with rt.block_switch.on(SELECTIVE if mode == "selective" else FULL):
                    out = self._call(stage, x)
                self.counters.checkpointed_blocks += rt.block_switch.checkpointed - before
            elif recompute and mode == "selective":
                out = self._forward_caching(stage, mb, x)
            elif recompute and not recompute_before_backward:
                out = checkpoint(self._call, stage, x, use_reentrant=False)
            else:
                out = self._call(stage, x)
            if last:
                value, count, out = self.loss(out, self.targets[mb], mb % rt.microbatches)
                self.losses.append(value)
                self.counts.append(count)
            else:
                messages = self._messages(stage, out)
                out = join(messages)
        if self.train:
            self.saved[(stage, mb)] = (x, None if recompute_before_backward else out)
            self.counters.live_activations += 1
            self.counters.peak_live_activations = max(self.counters.peak_live_activations, self.counters.live_activations)
        for consumer, message in zip(self.routes.consumers(stage), messages):
            self.mailbox.put(Kind.F, stage, consumer, mb, message.detach())

    def _forward_caching(self, stage: int, mb: int, x: torch.Tensor):
        """The forward under "selective" of a whole stage (a split backward's, or a stage without
        blocks; blocks otherwise checkpoint themselves, activation_checkpoint.py): the policy's results
        (activation_checkpoint.py) are cached for the recompute before the backward, and the graph
        built here is dropped (the caller keeps no output with grad; torch's checkpoint runs this
        forward so that its hooks keep nothing but the cache, and its own recompute never runs).

        Why not keep this graph and let torch recompute the whole stage inside the backward:
        - the cache is read back by op and position, so the recompute must dispatch the forward's
          ops again. Inside a backward pass the hooks of the stage's FSDP units take other paths
          (a module's pre-forward is skipped once its pre-backward has run) and dispatch other ops
          (profiler ranges), which torch's selective checkpointing refuses (a block's checkpoint
          sits inside its FSDP unit, and sees none of them). Before the backward they run as in
          the forward.
        - a split backward's I and W are two passes over one graph; torch recomputes per pass and
          hands its selective cache out once, so W would find it spent.
        """
        caching, cached = selective_contexts()
        self.selective_caches[(stage, mb)] = cached
        return checkpoint(self._call, stage, x, use_reentrant=False,
                          context_fn=lambda: (caching, contextlib.nullcontext()))

    def _recompute(self, stage: int, mb: int, x: torch.Tensor) -> torch.Tensor:
        """The forward again, with the RNG as the first time, now building the graph the backward
        walks (B's, or I's and W's; under "selective", with the forward's cached results)."""
        cached = self.selective_caches.pop((stage, mb), None)
        with _restored_rng(self.rng_states.pop((stage, mb)), self.rt.device), torch.enable_grad():
            with cached if cached is not None else contextlib.nullcontext():
                out = self._call(stage, x)
            if stage == self.rt.n_stages - 1:
                return self.loss(out, self.targets[mb], mb % self.rt.microbatches)[2]
            return join(self._messages(stage, out))

    def backward(self, stage: int, mb: int, is_last_backward: bool) -> None:
        rt = self.rt
        x, out = self.saved.pop((stage, mb))
        if rt.before_backward is not None:
            rt.before_backward(stage, is_last_backward)
        if out is None:
            out = self._recompute(stage, mb, x)
        grad = self._output_grad(stage, mb)
        if out.requires_grad:  # a stage with everything frozen up to here has nothing to do
            with self.loss.context() if grad is None else contextlib.nullcontext():
                torch.autograd.backward(out, grad)
        self.counters.live_activations -= 1
        if stage > 0:
            self._send_input_grad(stage, mb, x.grad if x.grad is not None else torch.zeros_like(x))

    def backward_input(self, stage: int, mb: int) -> None:
        """I: the input gradient only, sent on at once. What W needs stays: the gradients I saw
        where weight branches leave the input-gradient chain (backward_halves.py), or, for the
        first stage (token ids: no input gradient), the output and its gradient for a whole
        backward at W. Data parallelism neither reduces nor reshards here."""
        rt = self.rt
        x, out = self.saved.pop((stage, mb))
        if rt.before_backward is not None:
            rt.before_backward(stage, False)
        if out is None:
            out = self._recompute(stage, mb, x)
        grad = self._output_grad(stage, mb)
        pending = None
        if stage > 0 and out.requires_grad and x.requires_grad:
            with self.loss.context() if grad is None else contextlib.nullcontext():
                input_grad, pending = backward_input(out, grad, x)
        elif stage > 0:
            input_grad = torch.zeros_like(x)  # nothing before this stage can change its output
        self.pending_weight_grads[(stage, mb)] = pending if pending is not None else (out, grad)
        if stage > 0:
            self._send_input_grad(stage, mb, input_grad)

    def backward_weight(self, stage: int, mb: int, is_last_backward: bool) -> None:
        """W: the weight gradients, from what I kept; frees the activation."""
        rt = self.rt
        pending = self.pending_weight_grads.pop((stage, mb))
        if rt.before_backward is not None:
            rt.before_backward(stage, is_last_backward)
        if isinstance(pending, PendingWeightGrad):
            with self.loss.context():
                backward_weight(pending)
            if rt.after_weight_backward is not None:
                rt.after_weight_backward(stage)
        else:  # a whole backward: the hooks of data parallelism run inside it as in B
            out, grad = pending
            if out.requires_grad:
                with self.loss.context() if grad is None else contextlib.nullcontext():
                    torch.autograd.backward(out, grad)
        self.counters.live_activations -= 1

    def finish(self) -> torch.Tensor:
        self.mailbox.close()
        if self.losses:
            # float64: a count over a large global batch is exact, and so is the final sum of sums.
            return torch.stack([torch.stack(self.losses).double().sum(), torch.stack(self.counts).double().sum()])
        return torch.zeros(2, dtype=torch.float64, device=self.rt.device)



def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def _restored_rng(state: tuple, device: torch.device):
    """Run with the RNG as it was at `state` (dropout draws the same masks), then put it back."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield
