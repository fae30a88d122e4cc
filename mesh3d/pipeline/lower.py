"""From a compute schedule to what each rank runs: timing, communication, validation, simulation.

- `timeline()` plays a compute schedule with per-action costs and cross-stage dependencies; a
  schedule that cannot finish (a rank waits on something that never comes) is rejected here.
- `lower()` inserts SEND/RECV actions. Every rank lists its messages in the order of the
  simulated send times (ties broken by one global key), so the two ends of every rank pair see
  their shared messages in the same order (gloo also matches them by tag).
- `check_lowered()` replays the lowered lists with only their order (no costs), with each
  rank's communication completing in issue order (NCCL, one stream), and requires every rank to
  reach its end. A lowered schedule that passes runs under any real timing.
- `simulate()` is the user-facing report: makespan, bubble fraction, peak live activations.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from mesh3d.pipeline.schedules import COMPUTE, Action, Kind, Schedule, build_schedule


class ScheduleError(ValueError):
    """A schedule that is incomplete or cannot finish."""


@dataclass(frozen=True)
class TimedAction:
    rank: int
    action: Action
    start: float
    end: float


def dependencies(action: Action, n_stages: int) -> list[Action]:
    """The compute actions `action` waits for (on this or another rank)."""
    s, j = action.stage, action.microbatch
    if action.kind == Kind.F:
        return [Action(s - 1, Kind.F, j)] if s > 0 else []
    if action.kind == Kind.B:
        later = [Action(s + 1, Kind.B, j)] if s < n_stages - 1 else []
        return [Action(s, Kind.F, j)] + later
    raise ValueError(f"{action} is not a compute action")


def _check_complete(schedule: Schedule) -> None:
    """Every forward (and, if any backward is listed, every backward) once, on the stage's rank."""
    seen: dict[Action, int] = {}
    has_backward = any(a.kind == Kind.B for acts in schedule.actions for a in acts)
    for rank, actions in enumerate(schedule.actions):
        for action in actions:
            key = Action(action.stage, action.kind, action.microbatch)
            if action.kind not in COMPUTE:
                raise ScheduleError(f"rank {rank}: {action} is not a compute action; lower() adds communication")
            if not 0 <= action.stage < schedule.n_stages or not 0 <= action.microbatch < schedule.microbatches:
                raise ScheduleError(f"rank {rank}: {action} is outside {schedule.n_stages} stages x {schedule.microbatches} microbatches")
            if schedule.stage_rank(action.stage) != rank:
                raise ScheduleError(f"rank {rank}: {action} belongs on rank {schedule.stage_rank(action.stage)}")
            if key in seen:
                raise ScheduleError(f"rank {rank}: {action} is listed twice")
            seen[key] = rank
    kinds = COMPUTE if has_backward else (Kind.F,)
    for s in range(schedule.n_stages):
        for j in range(schedule.microbatches):
            for kind in kinds:
                if Action(s, kind, j) not in seen:
                    raise ScheduleError(f"{schedule.name}: {Action(s, kind, j)} is never run")


def timeline(schedule: Schedule, f_cost: float = 1.0, b_cost: float = 2.0, comm_cost: float = 0.0) -> list[TimedAction]:
    """Start and end of every compute action: each rank runs its list in order, as soon as inputs exist."""
    _check_complete(schedule)
    if f_cost <= 0 or b_cost <= 0 or comm_cost < 0:
        raise ValueError(f"costs must be positive (comm_cost >= 0), got f={f_cost}, b={b_cost}, comm={comm_cost}")
    cost = {Kind.F: f_cost, Kind.B: b_cost}
    finished: dict[Action, float] = {}
    position = [0] * schedule.pp
    free_at = [0.0] * schedule.pp
    timed: list[TimedAction] = []
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(schedule.actions):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                deps = dependencies(action, schedule.n_stages)
                if any(dep not in finished for dep in deps):
                    break
                arrivals = [finished[d] + (comm_cost if schedule.stage_rank(d.stage) != rank else 0.0) for d in deps]
                start = max([free_at[rank], *arrivals])
                finished[action] = free_at[rank] = start + cost[action.kind]
                timed.append(TimedAction(rank, action, start, free_at[rank]))
                position[rank] += 1
                progress = True
    stuck = [(r, acts[position[r]]) for r, acts in enumerate(schedule.actions) if position[r] < len(acts)]
    if stuck:
        waits = "; ".join(
            f"rank {r} at {a} waits for {[str(d) for d in dependencies(a, schedule.n_stages) if d not in finished]}"
            for r, a in stuck
        )
        raise ScheduleError(f"schedule {schedule.name!r} cannot finish: {waits}")
    return timed


@dataclass(frozen=True)
class Message:
    """An activation (SEND_F) or gradient (SEND_B) going from one stage to the next/previous one."""

    kind: Kind  # SEND_F or SEND_B
    stage: int  # the stage that produces it
    microbatch: int

    @property
    def consumer_stage(self) -> int:
        return self.stage + 1 if self.kind == Kind.SEND_F else self.stage - 1


@dataclass(frozen=True)
class LoweredSchedule:
    """A schedule with its communication: what each rank runs, in order."""

    schedule: Schedule
    actions: tuple[tuple[Action, ...], ...]

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions))


def _message_of(action: Action) -> Message:
    """The message a SEND/RECV action carries, keyed by its producer."""
    if action.kind in (Kind.SEND_F, Kind.SEND_B):
        return Message(action.kind, action.stage, action.microbatch)
    if action.kind == Kind.RECV_F:
        return Message(Kind.SEND_F, action.stage - 1, action.microbatch)
    return Message(Kind.SEND_B, action.stage + 1, action.microbatch)


def lower(schedule: Schedule) -> LoweredSchedule:
    """Add SEND after each compute whose result another rank needs, RECV before its use; then check."""
    timed = timeline(schedule)
    n_stages = schedule.n_stages
    # (time, 0 for communication / 1 for compute, global tie-break) -> same message order on both ends.
    keyed: list[list[tuple]] = [[] for _ in range(schedule.pp)]
    for item in timed:
        action, rank = item.action, item.rank
        keyed[rank].append((item.start, 1, (), action))
        if action.kind == Kind.F and action.stage < n_stages - 1:
            kind, consumer = Kind.SEND_F, action.stage + 1
        elif action.kind == Kind.B and action.stage > 0:
            kind, consumer = Kind.SEND_B, action.stage - 1
        else:
            continue
        peer = schedule.stage_rank(consumer)
        if peer == rank:
            continue  # both stages on this rank: handed over in memory
        tie_break = (action.stage, kind.value, action.microbatch)
        keyed[rank].append((item.end, 0, tie_break, Action(action.stage, kind, action.microbatch, peer)))
        recv_kind = Kind.RECV_F if kind == Kind.SEND_F else Kind.RECV_B
        keyed[peer].append((item.end, 0, tie_break, Action(consumer, recv_kind, action.microbatch, rank)))
    actions = tuple(tuple(entry[-1] for entry in sorted(entries, key=lambda e: e[:3])) for entries in keyed)
    lowered = LoweredSchedule(schedule, actions)
    check_lowered(lowered)
    return lowered


def check_lowered(lowered: LoweredSchedule) -> None:
    """Replay the lowered lists by order alone and raise ScheduleError if any rank cannot finish.

    The model is the strictest a real backend imposes (NCCL with one communicator for the whole
    pp group): each rank runs its list in order; SEND and RECV are issued without blocking the
    rank, but the operations a rank issued complete one after the other, in issue order, each
    only when the other end has issued its half; a compute waits for the messages it consumes.
    Lists that finish here also finish with per-pair streams and with gloo, whatever the timing.
    """
    schedule = lowered.schedule
    n_stages = schedule.n_stages
    pair_order: dict[tuple[int, int], list[list[Message]]] = defaultdict(lambda: [[], []])
    for rank, actions in enumerate(lowered.actions):
        for action in actions:
            if action.kind not in COMPUTE:
                pair = (min(rank, action.peer), max(rank, action.peer))
                pair_order[pair][0 if rank == pair[0] else 1].append(_message_of(action))
    for (low, high), (seen_low, seen_high) in pair_order.items():
        if seen_low != seen_high:
            raise ScheduleError(f"ranks {low} and {high} list their messages in different orders")

    issued: list[list[Action]] = [[] for _ in range(schedule.pp)]
    head = [0] * schedule.pp  # per rank: the first issued operation not yet completed
    completed: set[Message] = set()
    position = [0] * schedule.pp
    done: set[Action] = set()

    def settle() -> None:
        matched = True
        while matched:
            matched = False
            for rank in range(schedule.pp):
                if head[rank] == len(issued[rank]):
                    continue
                action = issued[rank][head[rank]]
                peer = action.peer
                if head[peer] < len(issued[peer]) and _message_of(issued[peer][head[peer]]) == _message_of(action):
                    completed.add(_message_of(action))
                    head[rank] += 1
                    head[peer] += 1
                    matched = True

    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(lowered.actions):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                if action.kind in COMPUTE:
                    needed = dependencies(action, n_stages)
                    if any(d not in done for d in needed if schedule.stage_rank(d.stage) == rank):
                        break
                    remote = [d for d in needed if schedule.stage_rank(d.stage) != rank]
                    if any(_produced_message(d) not in completed for d in remote):
                        break
                    done.add(action)
                else:
                    issued[rank].append(action)
                position[rank] += 1
                progress = True
            settle()
    stuck = [(r, acts[position[r]]) for r, acts in enumerate(lowered.actions) if position[r] < len(acts)]
    pending = [issued[r][head[r]] for r in range(schedule.pp) if head[r] < len(issued[r])]
    if stuck or pending:
        where = "; ".join(f"rank {r} stuck at {a}" for r, a in stuck)
        raise ScheduleError(
            f"lowered schedule {schedule.name!r} cannot finish: {where or 'operations never matched: ' + ', '.join(map(str, pending))}"
        )


def _produced_message(dependency: Action) -> Message:
    kind = Kind.SEND_F if dependency.kind == Kind.F else Kind.SEND_B
    return Message(kind, dependency.stage, dependency.microbatch)


@dataclass(frozen=True)
class SimulationReport:
    """What a schedule costs: run `simulate()` to get one."""

    schedule: Schedule
    events: tuple[TimedAction, ...]
    makespan: float
    bubble_fraction: float  # 1 - total busy time / (pp * makespan)
    peak_activations: list[int]  # per pp rank: most stage-microbatch forwards held for their backward
    busy: list[float]  # per pp rank: time spent computing

    def __str__(self) -> str:
        s = self.schedule
        return (
            f"{s.name} pp={s.pp} microbatches={s.microbatches} virtual_stages={s.virtual_stages}: "
            f"makespan {self.makespan:g}, bubble {self.bubble_fraction:.2%}, "
            f"peak activations per rank {self.peak_activations}"
        )


def peak_live_activations(actions: tuple[Action, ...] | list[Action]) -> int:
    """Most forwards whose backward has not run yet, over one rank's list (forward-only: 0)."""
    if not any(a.kind == Kind.B for a in actions):
        return 0
    live = peak = 0
    for action in actions:
        if action.kind == Kind.F:
            live += 1
            peak = max(peak, live)
        elif action.kind == Kind.B:
            live -= 1
    return peak


def simulate_schedule(schedule: Schedule, *, f_cost: float = 1.0, b_cost: float = 2.0, comm_cost: float = 0.0) -> SimulationReport:
    """Simulate a schedule object (see `simulate` for the by-name form)."""
    events = timeline(schedule, f_cost, b_cost, comm_cost)
    makespan = max(e.end for e in events)
    busy = [0.0] * schedule.pp
    for e in events:
        busy[e.rank] += e.end - e.start
    bubble = 1.0 - sum(busy) / (schedule.pp * makespan)
    peaks = [peak_live_activations(acts) for acts in schedule.actions]
    return SimulationReport(schedule, tuple(events), makespan, bubble, peaks, busy)


def simulate(
    schedule: str,
    pp: int,
    microbatches: int,
    virtual_stages: int = 1,
    *,
    f_cost: float = 1.0,
    b_cost: float = 2.0,
    comm_cost: float = 0.0,
) -> SimulationReport:
    """Run a schedule on paper: costs per stage forward/backward, zero-cost messages by default.

    Returns a SimulationReport with `.makespan`, `.bubble_fraction` and `.peak_activations` (one
    per pp rank). Raises ValueError for sizes the schedule cannot run and ScheduleError if the
    lowered schedule could not finish.
    """
    built = build_schedule(schedule, pp, microbatches, virtual_stages)
    lower(built)  # rejects a schedule whose communication could not finish
    return simulate_schedule(built, f_cost=f_cost, b_cost=b_cost, comm_cost=comm_cost)
