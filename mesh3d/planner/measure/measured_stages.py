"""The three stages the planner measures, cut from the model whichever way it came in, and what
flows into each: the probe (probe.py), the timing of the parts (part_timing.py) and of data
parallelism (data_parallel_timing.py) all walk them the same way.

- first: the first end and block 0; middle: block 1; last: block n-1 and the last end.
- A model mesh3d cuts (the protocol, Hugging Face, nn.Sequential) gives them with `cut_stage`,
  each handing one tensor to the next.
- A traced model (model/traced/) is split by torch's pipeline frontend where blocks 1, 2 and n-1
  begin (1 and 2 when n = 3): a filler stage (blocks 2..n-2) runs only to hand the last stage its
  inputs. Its stages may hand on several tensors and skip stages (routes). Each measured stage is
  called as the runtime calls it (pipeline/runtime.py): what it receives joined into one tensor
  (the previous stage's message, then each skip producer's), what it sends joined likewise, so a
  backward starts from one output and ends at one input, and I + W (backward_halves.py) times
  what the runtime runs.

A traced model is captured with token ids of one microbatch's shape (the planner plans language
models: pm.step's inputs are token ids); torch.export may bake that shape into the graph, so each
microbatch size gets a capture of its own (kept with the model's capture, made once).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mesh3d.model.anatomy import Anatomy
from mesh3d.model.cut import cut_stage
from mesh3d.model.intake import anatomy_of
from mesh3d.model.traced.capture import TracedModel
from mesh3d.pipeline.routes import MessageSpec, StageRoutes, divide, join, pack, unpack

KINDS = ("first", "middle", "last")  # the stages measured, in the order they run


def token_ids(microbatch_size: int, seq_len: int) -> torch.Tensor:
    """One microbatch of token ids on meta: what a traced model is captured with."""
    return torch.zeros(microbatch_size, seq_len, dtype=torch.long, device="meta")


def planner_anatomy(model: nn.Module, seq_len: int, split_points: Sequence[str] | None = None) -> Anatomy:
    """The model's anatomy as `parallelize` would find it; a traced model captured with token ids
    of (1, seq_len) (torch's reason, as a ValueError, if it cannot be)."""
    return anatomy_of(model, (token_ids(1, seq_len),), split_points)


@dataclass
class MeasuredStages:
    """The stages to measure (and a traced model's filler), on meta copies of the model's parts."""

    stages: dict[str, nn.Module]  # "first", "middle", ("filler"), "last": in the order they run
    indices: dict[str, int]  # each one's stage number in its split
    routes: StageRoutes | None  # a traced split's; None: one tensor from each stage to the next


def measured_stages(model: nn.Module, anatomy: Anatomy, microbatch_size: int, seq_len: int) -> MeasuredStages:
    """Cut (or, traced, split at microbatches of `microbatch_size` x `seq_len`) the measured stages."""
    blocks = anatomy.block_names(model)
    n = len(blocks)
    if anatomy.traced is None:
        middle = range(1, 2) if n > 1 else range(0, 1)
        parts = {"first": (0, range(0, 1)), "middle": (1, middle), "last": (2, range(n - 1, n))}
        stages = {kind: cut_stage(model, anatomy, index, 3, layers) for kind, (index, layers) in parts.items()}
        return MeasuredStages(stages, {kind: index for kind, (index, _) in parts.items()}, None)
    if n < 3:
        raise ValueError(f"plan: {anatomy.name} has {n} blocks; the planner measures a model with at least 3")
    starts = [1, 2, n - 1] if n > 3 else [1, 2]
    split = _capture(model, anatomy, microbatch_size, seq_len).split([anatomy.block_path(blocks[i]) for i in starts])
    kinds = ["first", "middle", "filler", "last"] if n > 3 else list(KINDS)
    indices = {kind: index for index, kind in enumerate(kinds)}
    stages = {kind: split.stage(model, index) for kind, index in indices.items()}
    return MeasuredStages(stages, indices, StageRoutes(len(kinds), split.skips, split.takes))


_CAPTURES: weakref.WeakKeyDictionary[TracedModel, dict[tuple[int, int], TracedModel]] = weakref.WeakKeyDictionary()


def _capture(model: nn.Module, anatomy: Anatomy, microbatch_size: int, seq_len: int) -> TracedModel:
    """The model captured at microbatches of this shape: the anatomy's own capture, or one made once."""
    traced, shape = anatomy.traced, (microbatch_size, seq_len)
    if tuple(traced.inputs[0].shape) == shape:
        return traced
    captures = _CAPTURES.setdefault(traced, {})
    if shape not in captures:
        captures[shape] = TracedModel(traced.meta_model, (token_ids(*shape),), anatomy.name)
    return captures[shape]


class RoutedStage(nn.Module):
    """A traced stage as the runtime calls it: one joined tensor in (the messages of its producers,
    token ids for the first stage), one joined tensor out (a message per consumer), the last
    stage's output as it is. Records what each consumer's message holds, to divide the output."""

    def __init__(self, stage: nn.Module, index: int, routes: StageRoutes, received: list[MessageSpec]):
        super().__init__()
        self.stage, self.index, self.routes, self.received = stage, index, routes, received
        self.sent: list[MessageSpec] = []

    def forward(self, x: torch.Tensor):
        if self.index == 0:
            out = self.stage(x)
        else:
            messages = divide(x, self.received)
            out = self.stage(*[t for message, spec in zip(messages, self.received) for t in unpack(message, spec)])
        if self.index == self.routes.n_stages - 1:
            return out
        outputs = out if isinstance(out, tuple) else (out,)
        taken = [[outputs[k] for k in self.routes.takes[(self.index, c)]] for c in self.routes.consumers(self.index)]
        self.sent = [MessageSpec(tuple((_local(t).shape, t.dtype) for t in components)) for components in taken]
        return join([pack(components) for components in taken])


class StageFlow:
    """Walks the measured stages in order, handing each what the runtime would: `stage_and_input`
    gives a stage (as it is called) and its input, `hand_on` takes its output for the stages after.

    The stages are those of `measured`, prepared in place by the caller (materialized, in the
    compute dtype, tensor-parallel) before the walk; a traced model's filler runs (without a graph)
    when the last stage's input is asked for."""

    def __init__(self, measured: MeasuredStages, tokens: torch.Tensor):
        self.measured, self.tokens = measured, tokens
        self._outputs: dict[str, torch.Tensor] = {}  # a cut stage's output
        self._messages: dict[tuple[int, int], tuple[torch.Tensor, MessageSpec]] = {}  # traced: per route
        self._received: dict[str, list[MessageSpec]] = {}
        self._called: dict[str, RoutedStage] = {}

    def stage_and_input(self, kind: str) -> tuple[nn.Module, torch.Tensor]:
        """Stage `kind` as the runtime calls it, and its input (detached)."""
        x = self.input(kind)
        return self.called(kind, self.measured.stages[kind]), x

    def input(self, kind: str) -> torch.Tensor:
        """What stage `kind` receives: token ids first, then what the stages before it handed on."""
        measured = self.measured
        if kind == "first":
            return self.tokens
        if measured.routes is None:
            return self._outputs[KINDS[KINDS.index(kind) - 1]]
        if kind == "last" and "filler" in measured.stages and "filler" not in self._called:
            filler, x = self.stage_and_input("filler")
            # Left on meta by a timing (part_timing.py): the stages between would cost a model's
            # forward to materialize and run, and the last stage needs only inputs of their shapes.
            shapes_only = _on_meta(measured.stages["filler"]) and not x.is_meta
            with torch.no_grad():
                self.hand_on("filler", filler(x.to("meta") if shapes_only else x), materialize=shapes_only)
        index = measured.indices[kind]
        messages = [self._messages[(p, index)] for p in measured.routes.producers(index)]
        self._received[kind] = [spec for _, spec in messages]
        return join([message for message, _ in messages])

    def called(self, kind: str, stage: nn.Module) -> nn.Module:
        """`stage` (the measured one, or a fresh copy of it) as the runtime calls stage `kind`; a
        traced stage needs its input asked for first (what it receives is learned there)."""
        if self.measured.routes is None:
            return stage
        received = self._received.get(kind, [])
        routed = RoutedStage(stage, self.measured.indices[kind], self.measured.routes, received)
        self._called[kind] = routed
        return routed

    def hand_on(self, kind: str, out, materialize: bool = False) -> None:
        """Stage `kind`'s output (from a call of what `stage_and_input` gave), for the stages after it;
        `materialize`: an output on meta handed on as random values of its shapes."""
        out = _local(out[0] if isinstance(out, tuple) else out).detach()
        if self.measured.routes is None:
            self._outputs[kind] = out
            return
        routed = self._called[kind]
        consumers = self.measured.routes.consumers(routed.index)
        for consumer, message, spec in zip(consumers, divide(out, routed.sent), routed.sent):
            # a message arrives in a buffer of its own, not as a view of everything its producer sent
            message = _random_like(message) if materialize else message.clone()
            self._messages[(routed.index, consumer)] = (message, spec)

    def sent_bytes(self, kind: str) -> int:
        """Bytes stage `kind` sends on per call: all its messages to every later stage that takes them."""
        if self.measured.routes is None:
            out = self._outputs[kind]
            return out.numel() * out.element_size()
        index = self.measured.indices[kind]
        return sum(m.numel() * m.element_size() for (p, _), (m, _) in self._messages.items() if p == index)


def _on_meta(stage: nn.Module) -> bool:
    return any(_local(p).is_meta for p in stage.parameters())


def _random_like(t: torch.Tensor) -> torch.Tensor:
    """Values on CPU of `t`'s shape and dtype (a meta tensor's): what a message of it would carry."""
    if t.is_floating_point():
        return torch.randn(t.shape, dtype=t.dtype)
    return torch.zeros(t.shape, dtype=t.dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
