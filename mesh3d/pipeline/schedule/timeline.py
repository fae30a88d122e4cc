"""Replaying per-rank action lists: when each compute action of a schedule can run.

- `replay()` is the one loop every replay shares: each rank runs its list in order, as far as it
  can, until no rank can move. `timeline()` and `check_lowered()` (in `lower.py`) differ only in
  what it takes for one action to run.
- `timeline()` plays a compute schedule with per-action costs and cross-stage dependencies; a
  schedule that cannot finish (a rank waits on something that never comes) is rejected here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mesh3d.pipeline.schedule.ir import COMPUTE, Action, Kind, Schedule, ScheduleError


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
    if action.kind in (Kind.B, Kind.I):  # a schedule uses B throughout, or I and W throughout
        later = [Action(s + 1, action.kind, j)] if s < n_stages - 1 else []
        return [Action(s, Kind.F, j)] + later
    if action.kind == Kind.W:
        return [Action(s, Kind.I, j)]
    raise ValueError(f"{action} is not a compute action")


def backward_kinds(schedule: Schedule) -> tuple[Kind, ...]:
    """The backward kinds a schedule uses: (B,), (I, W), or () for forward only; mixing is an error."""
    used = {a.kind for acts in schedule.actions for a in acts} - {Kind.F}
    if not used:
        return ()
    if used == {Kind.B}:
        return (Kind.B,)
    if used == {Kind.I, Kind.W}:
        return (Kind.I, Kind.W)
    raise ScheduleError(
        f"{schedule.name}: backward actions {sorted(map(str, used))}; use B throughout, or I and W throughout"
    )


def _check_complete(schedule: Schedule) -> None:
    """Every forward (and, if any backward is listed, every backward) once, on the stage's rank."""
    seen: dict[Action, int] = {}
    for rank, actions in enumerate(schedule.actions):
        for action in actions:
            key = Action(action.stage, action.kind, action.microbatch)
            if action.kind not in COMPUTE:
                raise ScheduleError(f"rank {rank}: {action} is not a compute action; lower() adds communication")
            if not 0 <= action.stage < schedule.n_stages or not 0 <= action.microbatch < schedule.microbatches:
                raise ScheduleError(
                    f"rank {rank}: {action} is outside {schedule.n_stages} stages "
                    f"x {schedule.microbatches} microbatches"
                )
            if schedule.stage_rank(action.stage) != rank:
                raise ScheduleError(f"rank {rank}: {action} belongs on rank {schedule.stage_rank(action.stage)}")
            if key in seen:
                raise ScheduleError(f"rank {rank}: {action} is listed twice")
            seen[key] = rank
    kinds = (Kind.F, *backward_kinds(schedule))
    for s in range(schedule.n_stages):
        for j in range(schedule.microbatches):
            for kind in kinds:
                if Action(s, kind, j) not in seen:
                    raise ScheduleError(f"{schedule.name}: {Action(s, kind, j)} is never run")


def replay(
    actions_per_rank: Sequence[Sequence[Action]],
    try_run: Callable[[int, Action], bool],
    after_each_rank: Callable[[], None] | None = None,
) -> list[tuple[int, Action]]:
    """Run every rank's list in order until no rank can move; return where unfinished ranks stopped.

    `try_run(rank, action)` runs the action and returns True, or returns False, changing nothing,
    while it cannot run yet. Ranks take turns in rank order, each going as far as it can, and
    `after_each_rank` runs after every turn (whether or not the rank moved). The result lists
    (rank, next action) for every rank that did not reach its end; empty if all finished.
    """
    position = [0] * len(actions_per_rank)
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(actions_per_rank):
            while position[rank] < len(actions) and try_run(rank, actions[position[rank]]):
                position[rank] += 1
                progress = True
            if after_each_rank is not None:
                after_each_rank()
    return [(r, acts[position[r]]) for r, acts in enumerate(actions_per_rank) if position[r] < len(acts)]


def timeline(
    schedule: Schedule,
    f_cost: float | Sequence[float] = 1.0,
    b_cost: float | Sequence[float] = 2.0,
    comm_cost: float = 0.0,
    w_cost: float | Sequence[float] = 0.0,
) -> list[TimedAction]:
    """Start and end of every compute action: each rank runs its list in order, as soon as inputs exist.

    b_cost is a stage's whole backward; w_cost its weight-gradient part, so I costs b_cost - w_cost
    and W costs w_cost (0 by default: a split backward then times like a whole one). Each cost is
    one number for every stage, or one per stage (stages differ: the ends carry the embedding and
    the output layer).
    """
    if not schedule.__dict__.get("_checked_complete"):  # a planner replays one schedule at many costs
        _check_complete(schedule)
        object.__setattr__(schedule, "_checked_complete", True)  # a frozen dataclass: a memo, not a field
    n = schedule.n_stages
    per_stage = [_per_stage(c, n, name) for c, name in ((f_cost, "f_cost"), (b_cost, "b_cost"), (w_cost, "w_cost"))]
    for f, b, w in zip(*per_stage):
        if f <= 0 or b <= 0 or comm_cost < 0 or not 0 <= w < b:
            raise ValueError(
                f"costs must be positive with 0 <= w_cost < b_cost and comm_cost >= 0, got f={f}, b={b}, "
                f"w={w}, comm={comm_cost}"
            )
    costs = [{Kind.F: f, Kind.B: b, Kind.I: b - w, Kind.W: w} for f, b, w in zip(*per_stage)]
    finished: dict[Action, float] = {}
    free_at = [0.0] * schedule.pp
    timed: list[TimedAction] = []

    def run(rank: int, action: Action) -> bool:
        deps = dependencies(action, schedule.n_stages)
        if any(dep not in finished for dep in deps):
            return False
        arrivals = [finished[d] + (comm_cost if schedule.stage_rank(d.stage) != rank else 0.0) for d in deps]
        start = max([free_at[rank], *arrivals])
        finished[action] = free_at[rank] = start + costs[action.stage][action.kind]
        timed.append(TimedAction(rank, action, start, free_at[rank]))
        return True

    stuck = replay(schedule.actions, run)
    if stuck:
        waits = "; ".join(
            f"rank {r} at {a} waits for {[str(d) for d in dependencies(a, schedule.n_stages) if d not in finished]}"
            for r, a in stuck
        )
        raise ScheduleError(f"schedule {schedule.name!r} cannot finish: {waits}")
    return timed


def _per_stage(cost: float | Sequence[float], n_stages: int, name: str) -> list[float]:
    if isinstance(cost, (int, float)):
        return [float(cost)] * n_stages
    cost = [float(c) for c in cost]
    if len(cost) != n_stages:
        raise ValueError(f"{name} gives {len(cost)} per-stage costs for a schedule of {n_stages} stages")
    return cost
