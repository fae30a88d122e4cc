"""What crosses the stage boundaries: which of a stage's outputs each consumer takes, and how several
tensors travel as one message.

Most models hand one tensor from each stage to the next. A traced model (model/traced/) may hand
several, and may skip stages: stage 0's output read again by stage 3 is sent from 0 to 3 directly
(torchgpipe's portals), never relayed through 1 and 2; its gradient comes back the same way.

The runtime calls a stage as `stage(*inputs)`, the inputs being the components of the messages
from `producers(stage)` (the previous stage first, then skip producers in stage order), each
message's components in the order its producer's route lists them; a stage returns one tensor or
a tuple, and `takes[(producer, consumer)]` names the indices of that tuple one consumer receives.

A message of one component travels as that tensor. Several components travel as one flat tensor
(a differentiable concatenation), so every message stays one send and one receive, the lowering's
unit, and a stage's backward still starts from one output and ends at one input (the runtime
concatenates what a stage received, and what it sends, the same way): backward_halves.py is
unchanged. The components of such a message must share one floating-point dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mesh3d.pipeline.schedule.lower import check_skips, consumers, producers

Spec = tuple[torch.Size, torch.dtype]


@dataclass(frozen=True)
class MessageSpec:
    """The components of one message (shape and dtype of each, local shards), from the meta run."""

    components: tuple[Spec, ...]

    @property
    def wire(self) -> Spec:
        """What travels: the one component, or the flat concatenation of all of them."""
        if len(self.components) == 1:
            return self.components[0]
        return torch.Size([sum(shape.numel() for shape, _ in self.components)]), self.components[0][1]

    @property
    def numel(self) -> int:
        return self.wire[0].numel()


@dataclass(frozen=True)
class StageRoutes:
    """Skip connections and, per (producer, consumer) stage pair, the producer outputs it carries."""

    n_stages: int
    skips: tuple[tuple[int, int], ...] = ()
    takes: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def chain(cls, n_stages: int, outputs: int = 1) -> StageRoutes:
        """Each stage hands its one output (or its first `outputs` ones) to the next."""
        return cls(n_stages, (), {(s, s + 1): tuple(range(outputs)) for s in range(n_stages - 1)})

    def __post_init__(self):
        object.__setattr__(self, "skips", check_skips(self.skips, self.n_stages))
        for stage in range(self.n_stages - 1):
            for consumer in self.consumers(stage):
                if not self.takes.get((stage, consumer)):
                    raise ValueError(f"stage routes: stage {stage} sends nothing to its consumer {consumer}")

    def consumers(self, stage: int) -> list[int]:
        return consumers(stage, self.n_stages, self.skips)

    def producers(self, stage: int) -> list[int]:
        return producers(stage, self.skips)


def pack(components: list[torch.Tensor]) -> torch.Tensor:
    """One message of `components` (differentiable): the tensor itself, or their flat concatenation."""
    if len(components) == 1:
        return components[0]
    return torch.cat([c.reshape(-1) for c in components])


def unpack(message: torch.Tensor, spec: MessageSpec) -> list[torch.Tensor]:
    """The components of a message, as views of it."""
    if len(spec.components) == 1:
        return [message]
    sizes = [shape.numel() for shape, _ in spec.components]
    return [part.view(shape) for part, (shape, _) in zip(message.split(sizes), spec.components)]


def join(messages: list[torch.Tensor]) -> torch.Tensor:
    """Several messages as one tensor (what a stage's backward starts or ends at): flat, concatenated."""
    return messages[0] if len(messages) == 1 else torch.cat([m.reshape(-1) for m in messages])


def divide(joined: torch.Tensor, specs: list[MessageSpec]) -> list[torch.Tensor]:
    """The messages `join` made of `specs`' messages, each in its wire shape."""
    if len(specs) == 1:
        return [joined]
    return [part.view(spec.wire[0]) for part, spec in zip(joined.split([s.numel for s in specs]), specs)]
