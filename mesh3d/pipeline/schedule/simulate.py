"""Simulation: what a schedule costs on paper (makespan, bubble fraction, peak live activations).

`simulate()` is the user-facing report; it builds a schedule by name, lowers it to reject one
whose communication could not finish, and times its compute with `timeline()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mesh3d.pipeline.schedule.catalog import SCHEDULES, build_schedule
from mesh3d.pipeline.schedule.ir import RELEASES, Action, Kind, Schedule
from mesh3d.pipeline.schedule.lower import lower
from mesh3d.pipeline.schedule.never_drain import continuous_schedule, never_drain_stream
from mesh3d.pipeline.schedule.timeline import TimedAction, timeline


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
    """Most forwards whose backward has not finished with them yet (B, or W of a split backward:
    what W needs stays live until it runs), over one rank's list (forward-only: 0)."""
    if not any(a.kind in RELEASES for a in actions):
        return 0
    live = peak = 0
    for action in actions:
        if action.kind == Kind.F:
            live += 1
            peak = max(peak, live)
        elif action.kind in RELEASES:
            live -= 1
    return peak


def simulate_schedule(
    schedule: Schedule,
    *,
    f_cost: float | Sequence[float] = 1.0,
    b_cost: float | Sequence[float] = 2.0,
    w_cost: float | Sequence[float] = 0.0,
    comm_cost: float = 0.0,
) -> SimulationReport:
    """Simulate a schedule object (see `simulate` for the by-name form); a cost may be one per stage."""
    events = timeline(schedule, f_cost, b_cost, comm_cost, w_cost)
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
    w_cost: float = 0.0,
    comm_cost: float = 0.0,
    calls: int = 1,
) -> SimulationReport:
    """Run a schedule on paper: costs per stage forward/backward, zero-cost messages by default.

    `calls`: that many calls of `pm.step` in a row. A schedule that drains runs them one after the
    other (the report shows each call's events, `calls` times the makespan); a never-drain
    schedule ("pipedream", "pipedream_2bw") runs them as one stream, the next call's forwards
    entering while this call's backwards finish, and then its flush: with f + b per slot, K calls
    of m microbatches take (K*m + pp - 1) slots.

    `b_cost` is a stage's whole backward and `w_cost` its weight-gradient part: a split backward
    (zero-bubble schedules) costs b_cost - w_cost for I and w_cost for W.

    Returns a SimulationReport with `.makespan`, `.bubble_fraction` and `.peak_activations` (one
    per pp rank). Raises ValueError for sizes the schedule cannot run and ScheduleError if the
    lowered schedule could not finish.
    """
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ValueError(f"calls must be a positive integer, got {calls!r}")
    built = build_schedule(schedule, pp, microbatches, virtual_stages)
    if SCHEDULES[schedule].never_drains:
        never_drain_stream(schedule, pp, microbatches)  # rejects a stream whose calls could not finish
        stream = continuous_schedule(schedule, pp, microbatches, calls)
        return simulate_schedule(stream, f_cost=f_cost, b_cost=b_cost, w_cost=w_cost, comm_cost=comm_cost)
    lower(built)  # rejects a schedule whose communication could not finish
    one = simulate_schedule(built, f_cost=f_cost, b_cost=b_cost, w_cost=w_cost, comm_cost=comm_cost)
    if calls == 1:
        return one
    events = tuple(
        TimedAction(e.rank, e.action, e.start + c * one.makespan, e.end + c * one.makespan)
        for c in range(calls)
        for e in one.events
    )
    return SimulationReport(
        built, events, calls * one.makespan, one.bubble_fraction, one.peak_activations, [calls * b for b in one.busy]
    )
