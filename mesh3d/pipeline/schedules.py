"""Pipeline schedules as data: for each pp rank, the ordered list of compute actions it runs.

A schedule is the intermediate representation (IR) every other part of the engine reads:
`timeline.py` replays them with costs, `lower.py` adds the communication and checks the lists can
finish, `simulate.py` reports what they cost, `runtime.py` executes them, `draw.py` draws them.
Generators here only decide the order of compute on each rank; they know nothing about tensors or
process groups.

Stages are numbered 0..pp*v-1 along the model; with loop placement stage s lives on pp rank s % pp,
so rank r holds stages r, r+pp, r+2pp, ... (its "chunks" 0..v-1).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """What an action does. F and B are compute; the rest are added by lowering."""

    F = "F"  # forward of one stage on one microbatch
    B = "B"  # full backward (input and weight gradients) of one stage on one microbatch
    SEND_F = "SEND_F"  # send a forward activation to the next stage's rank
    RECV_F = "RECV_F"  # post the receive of a forward activation from the previous stage's rank
    SEND_B = "SEND_B"  # send an input gradient to the previous stage's rank
    RECV_B = "RECV_B"  # post the receive of an output gradient from the next stage's rank

    def __str__(self) -> str:
        return self.value


COMPUTE = (Kind.F, Kind.B)


@dataclass(frozen=True)
class Action:
    """One step of one rank's list: `kind` of `stage` on `microbatch` (and `peer` pp rank for P2P)."""

    stage: int
    kind: Kind
    microbatch: int
    peer: int | None = None

    def __str__(self) -> str:
        where = f"->{self.peer}" if self.kind in (Kind.SEND_F, Kind.SEND_B) else f"<-{self.peer}"
        suffix = where if self.peer is not None else ""
        return f"{self.kind}{self.microbatch}@s{self.stage}{suffix}"


def stage_to_rank(stage: int, pp: int, virtual_stages: int, placement: str = "loop") -> int:
    """The pp rank that holds `stage`.

    "loop": stage s on rank s % pp (Megatron's interleaving). "v": for two stages per rank, rank r
    holds r and 2*pp-1-r, so the first and last stage share rank 0 (zero-bubble V schedules).
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


def gpipe(pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """All forwards, then all backwards: simple, but every microbatch's activations are live at once."""
    actions = []
    for rank in range(pp):
        forwards = [Action(rank, Kind.F, j) for j in range(microbatches)]
        backwards = [Action(rank, Kind.B, j) for j in range(microbatches)]
        actions.append(tuple(forwards + backwards))
    return Schedule("gpipe", pp, microbatches, 1, tuple(actions))


def one_f_one_b(pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): pp-1-r warm-up forwards, then alternate, so at most pp activations are live."""
    actions = []
    for rank in range(pp):
        forwards = [Action(rank, Kind.F, j) for j in range(microbatches)]
        backwards = [Action(rank, Kind.B, j) for j in range(microbatches)]
        actions.append(tuple(_one_forward_one_backward(forwards, backwards, warmup=pp - 1 - rank)))
    return Schedule("1f1b", pp, microbatches, 1, tuple(actions))


def interleaved_one_f_one_b(pp: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B, for any microbatches >= pp.

    Microbatches go through each rank's chunks in rounds: a round is a group of >= pp
    consecutive microbatches that passes chunk 0, then chunk 1, ... (backwards in the reverse
    chunk order). With m a multiple of pp every round holds pp microbatches (Megatron's
    schedule); otherwise the m // pp rounds share the remainder, the first rounds one extra each.
    Rank r warms up with (v-1)*g + 2*(pp-1-r) forwards (g: the first round's size), then
    alternates one forward and one backward.
    """
    v = virtual_stages
    rounds = microbatches // pp
    sizes = [microbatches // rounds + (1 if k < microbatches % rounds else 0) for k in range(rounds)]
    actions = []
    for rank in range(pp):
        forwards: list[Action] = []
        backwards: list[Action] = []
        first = 0
        for size in sizes:
            batch = range(first, first + size)
            forwards += [Action(chunk * pp + rank, Kind.F, j) for chunk in range(v) for j in batch]
            backwards += [Action(chunk * pp + rank, Kind.B, j) for chunk in reversed(range(v)) for j in batch]
            first += size
        warmup = (v - 1) * sizes[0] + 2 * (pp - 1 - rank)
        actions.append(tuple(_one_forward_one_backward(forwards, backwards, warmup)))
    return Schedule("interleaved_1f1b", pp, microbatches, v, tuple(actions))


def _one_forward_one_backward(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        order += [forward, backward]
    order += backwards[len(forwards) - warmup :]
    return order


@dataclass(frozen=True)
class ScheduleSpec:
    generator: Callable[[int, int, int], Schedule]
    multi_stage: bool  # may hold more than one stage per rank (virtual_stages > 1)
    needs_pp_microbatches: bool  # deadlocks or idles with fewer microbatches than pp


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(gpipe, multi_stage=False, needs_pp_microbatches=False),
    "1f1b": ScheduleSpec(one_f_one_b, multi_stage=False, needs_pp_microbatches=True),
    "interleaved_1f1b": ScheduleSpec(interleaved_one_f_one_b, multi_stage=True, needs_pp_microbatches=True),
}


def check_schedule_config(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> None:
    """Raise ValueError with what to change if `schedule` cannot run with these sizes.

    Pure arithmetic, so every rank raises the same error before any collective.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    spec = SCHEDULES[schedule]
    for name, value in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if virtual_stages > 1 and not spec.multi_stage:
        multi = sorted(n for n, s in SCHEDULES.items() if s.multi_stage)
        raise ValueError(
            f"schedule {schedule!r} runs one stage per rank, but virtual_stages={virtual_stages}; "
            f"use virtual_stages=1 or a multi-stage schedule ({', '.join(multi)})"
        )
    if spec.needs_pp_microbatches and microbatches < pp:
        raise ValueError(
            f"schedule {schedule!r} needs microbatches >= pp, got microbatches={microbatches} with pp={pp}; "
            f"use at least {pp} microbatches (or schedule='gpipe')"
        )


def build_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The compute-only schedule IR for one of SCHEDULES, after checking the sizes."""
    check_schedule_config(schedule, pp, microbatches, virtual_stages)
    return SCHEDULES[schedule].generator(pp, microbatches, virtual_stages)
