"""The interpreter: runs one rank's lowered action list on real tensors.

Per step it splits the batch into microbatches, and for each action:
RECV posts an irecv into a buffer whose shape is known in advance (the stages were run on meta
tensors, locally); F runs a stage (the last stage adds the loss, scaled by 1/m) and keeps what
its backward needs; SEND posts an isend of the activation or input gradient; B runs the stage's
backward with the received output gradient. Receives are waited on just before the compute that
uses them, sends once at the end of the step. Stages on the same rank hand tensors over in memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from mesh3d.pipeline.lower import LoweredSchedule, lower
from mesh3d.pipeline.schedules import Kind

ACTIVATION_CHECKPOINT_MODES = ("never", "always", "except_last")


@dataclass
class RuntimeCounters:
    """What the last step did on this rank (reset at the start of every step)."""

    live_activations: int = 0  # stage-microbatch forwards held for their backward, right now
    peak_live_activations: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    recomputed_forwards: int = 0  # forwards run under activation checkpointing


class PipelineRuntime:
    """Executes a lowered schedule for one pp rank.

    Args:
        stages: this rank's stage modules, by stage index.
        meta_stages: every stage of the model on the meta device, used to learn boundary shapes.
        lowered: the lowered schedule (every rank's list; this runtime runs `pp_rank`'s).
        pp_rank: this rank's position on the pp axis.
        pp_global_ranks: global rank of every pp rank in this rank's pp group.
        group: the pp process group.
        loss_fn: loss_fn(output, target) -> mean loss of one microbatch.
        activation_checkpoint: "never", "always" or "except_last" (the last microbatch is kept).
        before_backward: called as before_backward(stage, is_last_backward_of_stage) before every
            backward; data parallelism uses it to reduce gradients once, on the last one.
        loss_context: a factory of the context the last stage's loss and its backward run in
            (tensor parallelism's loss_parallel).

    Stages may be tensor-parallel: what crosses a stage boundary is then the local shard of the
    activation (with sequence parallel, 1/tp of it), and the meta stages carry the same plan, so
    the shapes learned from them are local shapes.
    """

    def __init__(
        self,
        stages: dict[int, nn.Module],
        meta_stages: list[nn.Module],
        lowered: LoweredSchedule,
        pp_rank: int,
        pp_global_ranks: list[int],
        group: dist.ProcessGroup | None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        activation_checkpoint: str = "never",
        before_backward: Callable[[int, bool], None] | None = None,
        loss_context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    ):
        self.stages = stages
        self.meta_stages = meta_stages
        self.pp_rank = pp_rank
        self.pp_global_ranks = pp_global_ranks
        self.group = group
        self.loss_fn = loss_fn
        self.device = device
        self.activation_checkpoint = activation_checkpoint
        self.before_backward = before_backward
        self.loss_context = loss_context
        self.schedule = lowered.schedule
        self.n_stages = self.schedule.n_stages
        self.microbatches = self.schedule.microbatches
        self.train_actions = lowered.actions[pp_rank]
        self.eval_actions = lower(self.schedule.forward_only()).actions[pp_rank]
        self.counters = RuntimeCounters()  # of the last training step
        self.eval_counters = RuntimeCounters()  # of the last evaluation
        self._boundary_specs: dict[tuple, list[tuple[torch.Size, torch.dtype]]] = {}
        self.output_placements = None  # the model output's DTensor placements (tensor parallel), from the meta run
        self.output_ndim = 0
        last_backward = {}
        for index, action in enumerate(self.train_actions):
            if action.kind == Kind.B:
                last_backward[action.stage] = index
        self._last_backward_index = set(last_backward.values())

    def boundary_specs(self, microbatch: torch.Tensor, target: torch.Tensor | None) -> list[tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of every stage's output for this microbatch shape, from a meta run.

        The loss runs on the meta output too, so a target that does not fit the output fails on
        every rank here, not on the last stage's rank alone in the middle of the schedule. This is
        best effort: a loss that cannot run on meta tensors (class weights on a device, boolean
        masks, .item()) is not checked.
        """
        key = (tuple(microbatch.shape), microbatch.dtype, None if target is None else (tuple(target.shape), target.dtype))
        if key not in self._boundary_specs:
            x = torch.empty(microbatch.shape, dtype=microbatch.dtype, device="meta")
            specs = []
            with torch.no_grad():
                for index, stage in enumerate(self.meta_stages):
                    x = stage(x)
                    if not isinstance(x, torch.Tensor):
                        raise TypeError(
                            f"pipeline stage {index} returned {type(x).__name__}; mesh3d sends exactly one "
                            "activation tensor between stages, so a stage's forward must return one tensor"
                        )
                    if isinstance(x, DTensor) and index < self.n_stages - 1:
                        raise TypeError(
                            f"pipeline stage {index} returned a DTensor ({x.placements}); stages hand each other "
                            "plain local tensors, so the tp plan's last style in a stage must use use_local_output=True"
                        )
                    specs.append((x.to_local().shape if isinstance(x, DTensor) else x.shape, x.dtype))
                self.output_placements = tuple(x.placements) if isinstance(x, DTensor) else None
                self.output_ndim = x.ndim
                if target is not None:
                    try:
                        with self.loss_context():
                            self.loss_fn(x, torch.empty(target.shape, dtype=target.dtype, device="meta"))
                    except Exception as error:
                        # No meta kernel, data-dependent ops (.item(), masks) or real tensors mixed in:
                        # this check cannot tell, the real run will. Anything else is the loss's verdict.
                        if not isinstance(error, NotImplementedError) and "meta" not in str(error).lower():
                            raise ValueError(
                                f"loss_fn fails on the model's output {tuple(x.shape)} {x.dtype} and a target microbatch "
                                f"{tuple(target.shape)} {target.dtype}: {error}"
                            ) from error
            self._boundary_specs[key] = specs
        return self._boundary_specs[key]

    def check(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> list[tuple[torch.Size, torch.dtype]]:
        """Everything that can fail before the first message, on every rank; returns the boundary specs."""
        if torch.is_autocast_enabled(self.device.type):
            raise ValueError(
                "pm.step/evaluate ran under torch.autocast, which mesh3d does not support yet: stage-boundary "
                "dtypes are fixed before the step from a meta run, which autocast does not change. Cast the "
                "model to the dtype you want instead (e.g. model.to(torch.bfloat16))"
            )
        m = self.microbatches
        return self.boundary_specs(inputs[: len(inputs) // m], None if targets is None else targets[: len(targets) // m])

    def run(self, inputs: torch.Tensor, targets: torch.Tensor | None, *, train: bool) -> torch.Tensor:
        """Run every microbatch through this rank's actions; returns the sum of the microbatch
        losses computed here (0 on ranks without the last stage)."""
        specs = self.check(inputs, targets)
        m = self.microbatches
        input_chunks = inputs.to(self.device).chunk(m)
        target_chunks = targets.to(self.device).chunk(m) if targets is not None else None
        counters = RuntimeCounters()
        if train:
            self.counters = counters
        else:
            self.eval_counters = counters
        step = _Step(self, input_chunks, target_chunks, specs, train, counters)
        for index, action in enumerate(self.train_actions if train else self.eval_actions):
            step.execute(action, is_last_backward=index in self._last_backward_index)
        return step.finish()

    def tag(self, kind: Kind, producer_stage: int, microbatch: int) -> int:
        """A tag unique to one message within a step (gloo matches on it; NCCL ignores it)."""
        direction = 0 if kind in (Kind.SEND_F, Kind.RECV_F) else 1
        return (direction * self.n_stages + producer_stage) * self.microbatches + microbatch


class _Step:
    """The state of one step: mailboxes, what backwards need, losses, pending sends."""

    def __init__(self, runtime: PipelineRuntime, input_chunks, target_chunks, specs, train: bool, counters: RuntimeCounters):
        self.rt = runtime
        self.counters = counters
        self.inputs = input_chunks
        self.targets = target_chunks
        self.specs = specs
        self.train = train
        self.inbox: dict[tuple[Kind, int, int], object] = {}  # (F or B, consumer stage, mb) -> tensor or pending
        self.outbox: dict[tuple[Kind, int, int], torch.Tensor] = {}  # (F or B, producer stage, mb) -> tensor
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.losses: list[torch.Tensor] = []
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []

    def execute(self, action, is_last_backward: bool) -> None:
        kind, stage, mb = action.kind, action.stage, action.microbatch
        if kind == Kind.F:
            self.forward(stage, mb)
        elif kind == Kind.B:
            self.backward(stage, mb, is_last_backward)
        elif kind in (Kind.RECV_F, Kind.RECV_B):
            producer = stage - 1 if kind == Kind.RECV_F else stage + 1
            shape, dtype = self.specs[producer if kind == Kind.RECV_F else stage]  # stage's own output for a grad
            buffer = torch.empty(shape, dtype=dtype, device=self.rt.device)
            source = self.rt.pp_global_ranks[action.peer]
            work = dist.irecv(buffer, src=source, group=self.rt.group, tag=self.rt.tag(kind, producer, mb))
            self.counters.bytes_received += buffer.numel() * buffer.element_size()
            self.inbox[(Kind.F if kind == Kind.RECV_F else Kind.B, stage, mb)] = (work, buffer)
        else:
            tensor = self.outbox.pop((Kind.F if kind == Kind.SEND_F else Kind.B, stage, mb)).contiguous()
            shape, dtype = self.specs[stage if kind == Kind.SEND_F else stage - 1]
            if tensor.shape != shape or tensor.dtype != dtype:
                what = "output" if kind == Kind.SEND_F else "input gradient"
                raise RuntimeError(
                    f"stage {stage} produced an {what} of {tuple(tensor.shape)} {tensor.dtype} for microbatch {mb}, "
                    f"but the meta run gave {tuple(shape)} {dtype}: a stage's output must depend only on its input's "
                    "shape and dtype"
                )
            target = self.rt.pp_global_ranks[action.peer]
            work = dist.isend(tensor, dst=target, group=self.rt.group, tag=self.rt.tag(kind, stage, mb))
            self.sends.append((work, tensor))
            self.counters.bytes_sent += tensor.numel() * tensor.element_size()
            self.counters.messages_sent += 1

    def take(self, kind: Kind, stage: int, mb: int) -> torch.Tensor:
        item = self.inbox.pop((kind, stage, mb))
        if isinstance(item, tuple):
            work, buffer = item
            work.wait()
            return buffer
        return item

    def hand_over(self, kind: Kind, producer: int, consumer: int, mb: int, tensor: torch.Tensor) -> None:
        if self.rt.schedule.stage_rank(consumer) == self.rt.pp_rank:
            self.inbox[(kind, consumer, mb)] = tensor
        else:
            self.outbox[(kind, producer, mb)] = tensor

    def forward(self, stage: int, mb: int) -> None:
        rt, last = self.rt, stage == self.rt.n_stages - 1
        x = self.inputs[mb] if stage == 0 else self.take(Kind.F, stage, mb)
        if self.train and stage > 0 and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        module = rt.stages[stage]
        recompute = self.train and (
            rt.activation_checkpoint == "always" or (rt.activation_checkpoint == "except_last" and mb != rt.microbatches - 1)
        )
        with torch.set_grad_enabled(self.train):
            if recompute:
                out = checkpoint(module, x, use_reentrant=False)
                self.counters.recomputed_forwards += 1
            else:
                out = module(x)
            if last:
                with rt.loss_context():
                    loss = rt.loss_fn(out, self.targets[mb])
                self.losses.append((loss.to_local() if isinstance(loss, DTensor) else loss).detach())
                out = loss / rt.microbatches  # scaled before backward, so grads accumulate to the global mean
        if self.train:
            self.saved[(stage, mb)] = (x, out)
            self.counters.live_activations += 1
            self.counters.peak_live_activations = max(self.counters.peak_live_activations, self.counters.live_activations)
        if not last:
            self.hand_over(Kind.F, stage, stage + 1, mb, out.detach())

    def backward(self, stage: int, mb: int, is_last_backward: bool) -> None:
        rt = self.rt
        x, out = self.saved.pop((stage, mb))
        if rt.before_backward is not None:
            rt.before_backward(stage, is_last_backward)
        grad = None if stage == rt.n_stages - 1 else self.take(Kind.B, stage, mb)
        if out.requires_grad:  # a stage with everything frozen up to here has nothing to do
            with rt.loss_context() if grad is None else contextlib.nullcontext():
                torch.autograd.backward(out, grad)
        self.counters.live_activations -= 1
        if stage > 0:
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            self.hand_over(Kind.B, stage, stage - 1, mb, grad)

    def finish(self) -> torch.Tensor:
        for work, _ in self.sends:
            work.wait()
        if self.losses:
            return torch.stack(self.losses).sum()
        return torch.zeros((), device=self.rt.device)
