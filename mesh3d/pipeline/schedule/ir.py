"""Pipeline schedules as data: for each pp rank, the ordered list of compute actions it runs.

A schedule is the intermediate representation (IR) every other part of the engine reads:
`timeline.py` replays them with costs, `lower.py` adds the communication and checks the lists can
finish, `simulate.py` reports what they cost, `runtime.py` executes them, `draw.py` draws them.
The generators (`generators.py`: GPipe, 1F1B, interleaved 1F1B; `zero_bubble.py`; `dualpipe_v.py`) only decide the
order of compute on each rank; they know nothing about tensors or process groups. `catalog.py`
names them.

Stages are numbered 0..pp*v-1 along the model; with loop placement stage s lives on pp rank s % pp,
so rank r holds stages r, r+pp, r+2pp, ... (its "chunks" 0..v-1).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """What an action does. F and B are compute; the rest are added by lowering."""

    F = "F"  # forward of one stage on one microbatch
    B = "B"  # full backward (input and weight gradients) of one stage on one microbatch
    # input-gradient half of a backward (zero-bubble schedules): what the previous stage waits for.
    # The name is the schedule notation's letter (F, B, I, W), used as Kind.I throughout.
    I = "I"  # noqa: E741
    W = "W"  # weight-gradient half of a backward: nobody waits for it; it frees the activation
    SEND_F = "SEND_F"  # send a forward activation to the next stage's rank
    RECV_F = "RECV_F"  # post the receive of a forward activation from the previous stage's rank
    SEND_B = "SEND_B"  # send an input gradient to the previous stage's rank
    RECV_B = "RECV_B"  # post the receive of an output gradient from the next stage's rank
    U = "U"  # never-drain schedules: the optimizer update of a stage, after the backward completing it
    TIE = "TIE"  # never-drain schedules: a tied weight's update, joined by every rank holding a copy

    def __str__(self) -> str:
        return self.value


COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)
COMMUNICATION = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)
BACKWARD_INPUT = (Kind.B, Kind.I)  # a backward that produces the input gradient (sent to the previous stage)
RELEASES = (Kind.B, Kind.W)  # the action after which a forward's activation is no longer held


@dataclass(frozen=True)
class Action:
    """One step of one rank's list: `kind` of `stage` on `microbatch` (and `peer` pp rank for P2P).

    A message normally goes between adjacent stages (SEND_F from s to s+1, SEND_B from s to s-1);
    a skip connection's message goes further, and `far_stage` names the stage at its other end
    (the consumer of a SEND_F or the producer of a RECV_F, and so on; None: the adjacent one).
    """

    stage: int
    kind: Kind
    microbatch: int
    peer: int | None = None
    far_stage: int | None = None

    def __str__(self) -> str:
        where = f"->{self.peer}" if self.kind in (Kind.SEND_F, Kind.SEND_B) else f"<-{self.peer}"
        suffix = where if self.peer is not None else ""
        skip = f"(s{self.far_stage})" if self.far_stage is not None else ""
        return f"{self.kind}{self.microbatch}@s{self.stage}{suffix}{skip}"

    @property
    def other_stage(self) -> int:
        """The stage at the other end of a message: `far_stage`, or the adjacent stage."""
        if self.far_stage is not None:
            return self.far_stage
        return self.stage + 1 if self.kind in (Kind.SEND_F, Kind.RECV_B) else self.stage - 1


def stage_to_rank(stage: int, pp: int, virtual_stages: int, placement: str = "loop") -> int:
    """The pp rank that holds `stage`.

    "loop": stage s on rank s % pp (Megatron's interleaving). "v": for two stages per rank, rank r
    holds r and 2*pp-1-r, so the first and last stage share rank 0 (the V schedules: zbv, dualpipev).
    """
    if placement == "loop":
        return stage % pp
    if placement == "v":
        if virtual_stages != 2:
            raise ValueError(f"V placement needs exactly 2 stages per rank, got virtual_stages={virtual_stages}")
        return stage if stage < pp else 2 * pp - 1 - stage
    raise ValueError(f"unknown placement {placement!r}; use 'loop' or 'v'")


class ScheduleError(ValueError):
    """A schedule that is incomplete or cannot finish."""


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists for `pp` ranks, `microbatches` microbatches, `virtual_stages` per rank."""

    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]  # actions[r]: what pp rank r runs, in order
    placement: str = "loop"

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages

    def stage_rank(self, stage: int) -> int:
        return stage_to_rank(stage, self.pp, self.virtual_stages, self.placement)

    @functools.cached_property
    def splits_backward(self) -> bool:
        """Whether backwards run as I and W (zero-bubble schedules) rather than as B (asked per
        action by the planner's walks: computed once)."""
        return any(a.kind == Kind.I for acts in self.actions for a in acts)

    def local_stages(self, rank: int) -> list[int]:
        return [s for s in range(self.n_stages) if self.stage_rank(s) == rank]

    def forward_only(self) -> Schedule:
        """The same forwards in the same order, no backwards: for evaluation."""
        kept = tuple(tuple(a for a in acts if a.kind == Kind.F) for acts in self.actions)
        return Schedule(self.name + "/forward", self.pp, self.microbatches, self.virtual_stages, kept, self.placement)

    def __str__(self) -> str:
        lines = [f"{self.name}: pp={self.pp} microbatches={self.microbatches} virtual_stages={self.virtual_stages}"]
        lines += [f"  rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions)]
        return "\n".join(lines)
