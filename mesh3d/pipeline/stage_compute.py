"""One step's compute on this rank's stages: F, B, I, W, and the recompute before a backward.

`StageCompute` holds what the actions of a step share while it runs (the mailbox, what each
backward needs, the losses) and runs each action the interpreter (runtime.py) hands it: F runs a
stage (the last stage adds the loss the step hands it, already scaled: by 1/m, or by the global
count) and keeps what its backward needs (under activation checkpointing,
activation_checkpoint.py); B runs the stage's backward with the received output gradient; I and
W split it (backward_halves.py); RECV and SEND go to the mailbox (p2p.py); U and TIE to the
weight versions of a never-drain schedule (weight_versions.py). Under a profiler each action is a
span named by its kind, stage and microbatch (action_spans.py). torch keeps the like in
pipelining's stage.py.

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
from torch.autograd import profiler

from mesh3d.model.fused_head_loss import head_targets
from mesh3d.pipeline.action_spans import action_span
from mesh3d.pipeline.activation_checkpoint import ActivationCheckpointing, restored_rng, rng_state
from mesh3d.pipeline.backward_halves import PendingWeightGrad, backward_input, backward_weight
from mesh3d.pipeline.p2p import Mailbox, Traffic
from mesh3d.pipeline.routes import MessageSpec, StageRoutes, divide, join, pack, unpack
from mesh3d.pipeline.schedule.ir import Action, Kind
from mesh3d.pipeline.weight_versions import WeightVersions

# The key of a microbatch's per-sample dict that holds the context its stage calls run in (context
# parallelism's attention, bound to the microbatch); not an identifier, so never a keyword's name.
CALL_CONTEXT = "<call context>"


class MicrobatchLoss(Protocol):
    """The last stage's loss for one step or evaluation, handed to `run` by the step
    (step/global_loss.py builds it from the user's loss_fn and the step's scale)."""

    def __call__(
        self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], target: torch.Tensor, microbatch: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss value to report, the count it stands for, the scaled tensor to backpropagate, the
        router term to report) of the step's `microbatch`-th microbatch; `output` is the last
        stage's, with the microbatch's routing sums where the model has a router loss."""

    def context(self) -> AbstractContextManager:
        """The context the loss's backward runs in (tensor parallelism's loss_parallel)."""


@dataclass
class RuntimeCounters(Traffic):
    """What the last training step did on this rank (reset at the start of every step)."""

    live_activations: int = 0  # stage-microbatch forwards held for their backward, right now
    peak_live_activations: int = 0
    recomputed_forwards: int = 0  # stage-microbatch forwards run under activation checkpointing
    checkpointed_blocks: int = 0  # of their block forwards, those checkpointed (and recomputed) one by one


@dataclass(frozen=True)
class LocalStages:
    """This rank's stages and what computing them needs, fixed for the runtime's life (its
    arguments of the same names: PipelineRuntime)."""

    modules: dict[int, nn.Module]  # by stage index
    n_stages: int
    microbatches: int  # per step (or per never-drain call)
    routes: StageRoutes
    device: torch.device
    checkpointing: ActivationCheckpointing
    takes: list[frozenset[str]]  # by stage index: the per-sample inputs its forward takes
    before_backward: Callable[[int, bool], None] | None
    after_weight_backward: Callable[[int], None] | None


class StageCompute:
    """What the actions of a step share while it runs: the mailbox, what backwards need, losses.
    Under a never-drain schedule one lives from the first call to the flush, carrying the
    backwards and messages a call leaves to the next (never_drain_calls.py).

    `versions`: the weight versions each F and B use and U and TIE update (never-drain training);
    None otherwise (an evaluation runs on the weights the parameters hold)."""

    def __init__(
        self,
        stages: LocalStages,
        input_chunks,
        target_chunks,
        mailbox: Mailbox,
        loss: MicrobatchLoss,
        train: bool,
        counters: RuntimeCounters,
        specs: dict[tuple[int, int], MessageSpec],
        versions: WeightVersions | None = None,
    ):
        self.stages = stages
        self.routes = stages.routes
        self.specs = specs
        self.counters = counters
        self.inputs = input_chunks
        self.targets = target_chunks
        # by microbatch: {name: its slice} of the step's per-sample inputs (the runtime sets them)
        self.per_sample: dict[int, dict[str, torch.Tensor]] | list[dict[str, torch.Tensor]] = {}
        self.mailbox = mailbox
        self.loss = loss
        self.train = train
        self.versions = versions
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # from I, for its W: a PendingWeightGrad, or (output, output gradient) for a whole backward
        self.pending_weight_grads: dict[tuple[int, int], PendingWeightGrad | tuple] = {}
        self.rng_states: dict[tuple[int, int], tuple] = {}  # forwards to recompute before their backward
        self.selective_caches: dict[tuple[int, int], AbstractContextManager] = {}  # their cached results ("selective")
        self.losses: list[torch.Tensor] = []
        self.counts: list[torch.Tensor] = []
        self.router_terms: list[torch.Tensor] = []

    def execute(self, action: Action, is_last_backward: bool) -> None:
        """Run one action (a never-drain step asks its update rule whether a backward is the last);
        while a profiler records, in a span named by the action (action_spans.py)."""
        if not profiler._is_profiler_enabled:  # one flag read: no span, no cost, when nothing records
            self._run(action, is_last_backward)
            return
        with action_span(action):
            self._run(action, is_last_backward)

    def _run(self, action: Action, is_last_backward: bool) -> None:
        kind = action.kind
        versions = self.versions
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

    def _call(self, stage: int, mb: int, x: torch.Tensor):
        """The stage on its inputs: the components of the joined messages, in the routes' order, and
        by keyword the microbatch's per-sample inputs it takes."""
        takes = self.stages.takes[stage]
        given = self.per_sample[mb] if self.per_sample else {}
        extra = {name: t for name, t in given.items() if name in takes}
        around = given.get(CALL_CONTEXT, contextlib.nullcontext())
        if stage == 0:
            inputs = [x]
        else:
            producers = self.routes.producers(stage)
            messages = divide(x, [self.specs[(p, stage)] for p in producers])
            inputs = [t for p, message in zip(producers, messages) for t in unpack(message, self.specs[(p, stage)])]
        # the last stage's head, if fused with the loss (model/fused_head_loss.py), computes it against these
        last = stage == self.stages.n_stages - 1 and self.targets is not None
        targets = self.targets[mb] if last else None
        with around, head_targets(targets):
            return self.stages.modules[stage](*inputs, **extra)

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
        if stage == self.stages.n_stages - 1:
            return None
        return join([self.mailbox.take(Kind.B, stage, c, mb) for c in self.routes.consumers(stage)])

    def forward(self, stage: int, mb: int) -> None:
        local, last = self.stages, stage == self.stages.n_stages - 1
        x = self._received(stage, mb)
        if self.train and stage > 0 and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        choice = local.checkpointing.choose(stage, mb, self.train)
        if choice.recompute:
            self.counters.recomputed_forwards += 1
        if choice.before_backward:
            self.rng_states[(stage, mb)] = rng_state(local.device)
        messages = []
        with torch.set_grad_enabled(choice.grad):
            out, cached, blocks = local.checkpointing.forward(choice, self._call, stage, mb, x)
            self.counters.checkpointed_blocks += blocks
            if cached is not None:
                self.selective_caches[(stage, mb)] = cached
            if last:
                value, count, out, router = self.loss(out, self.targets[mb], mb % local.microbatches)
                self.losses.append(value)
                self.counts.append(count)
                self.router_terms.append(router)
            else:
                messages = self._messages(stage, out)
                out = join(messages)
        if self.train:
            self.saved[(stage, mb)] = (x, None if choice.before_backward else out)
            self.counters.live_activations += 1
            self.counters.peak_live_activations = max(
                self.counters.peak_live_activations, self.counters.live_activations
            )
        for consumer, message in zip(self.routes.consumers(stage), messages):
            self.mailbox.put(Kind.F, stage, consumer, mb, message.detach())

    def _recompute(self, stage: int, mb: int, x: torch.Tensor) -> torch.Tensor:
        """The forward again, with the RNG as the first time, now building the graph the backward
        walks (B's, or I's and W's; under "selective", with the forward's cached results)."""
        cached = self.selective_caches.pop((stage, mb), None)
        with restored_rng(self.rng_states.pop((stage, mb)), self.stages.device), torch.enable_grad():
            with cached if cached is not None else contextlib.nullcontext():
                out = self._call(stage, mb, x)
            if stage == self.stages.n_stages - 1:
                return self.loss(out, self.targets[mb], mb % self.stages.microbatches)[2]
            return join(self._messages(stage, out))

    def backward(self, stage: int, mb: int, is_last_backward: bool) -> None:
        local = self.stages
        x, out = self.saved.pop((stage, mb))
        if local.before_backward is not None:
            local.before_backward(stage, is_last_backward)
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
        local = self.stages
        x, out = self.saved.pop((stage, mb))
        if local.before_backward is not None:
            local.before_backward(stage, False)
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
        local = self.stages
        pending = self.pending_weight_grads.pop((stage, mb))
        if local.before_backward is not None:
            local.before_backward(stage, is_last_backward)
        if isinstance(pending, PendingWeightGrad):
            with self.loss.context():
                backward_weight(pending)
            if local.after_weight_backward is not None:
                local.after_weight_backward(stage)
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
            sums = [torch.stack(values).double().sum() for values in (self.losses, self.counts, self.router_terms)]
            return torch.stack(sums)
        return torch.zeros(3, dtype=torch.float64, device=self.stages.device)
