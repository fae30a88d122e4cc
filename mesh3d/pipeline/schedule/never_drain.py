"""Pipelines that never drain: PipeDream (weight stashing) and PipeDream-2BW.

Every other schedule ends each step with every backward done: the pipeline fills and drains once
per call of `pm.step`. Here the forwards of the next call's batch enter while the backwards of
this call's last microbatches still run, so the pipeline fills once and then stays full: K calls
of m microbatches take K*m + p - 1 slots of one forward and one backward each, not K*(m + p - 1).

The order of compute is 1F1B over the microbatches of every call in a row (microbatches are
numbered across calls: call t runs t*m .. t*m+m-1). Weights then change inside the pipeline, and
each schedule names which weights a microbatch sees (`UpdateRule`), with p stages (one per pp
rank), stage s, microbatch k:

- "pipedream": each microbatch is a minibatch of its own. Stage s updates its weights after each
  backward (U after every B); microbatch k's forward and backward at stage s both use stage s's
  weights after the updates of microbatches 0 .. k-(p-s) (weight stashing keeps that version
  from the forward until the backward). In the 1F1B order these are exactly the updates that ran
  on the stage before k's forward.
- "pipedream_2bw": batch t (the m microbatches of call t, gradients accumulated) is computed with
  W(t-1) and gives W(t+1) = W(t) - update(grad f(W(t-1); batch t)), W(-1) = W(0): stage s
  updates after the last backward of each batch, and keeps at most two versions.

A call ends, on each rank, right after the backward that follows its last forward of the call's
batch; the backwards of the batch's last p-1-s microbatches at stage s run during the next call,
or at `pm.flush()`. Rank r gets to its call's end r forwards after rank 0 (the batch's last
microbatch still travels to the loss), and the call's closing collective (the loss every rank
returns) makes the earlier ranks wait for it: (p-1)*f per call, where a flush costs (p-1)*(f+b).
`simulate(..., calls=K)` shows the stream without that wait, as PipeDream runs with the next batch
already at hand.

`NeverDrainStream` lowers the stream twice, small (one call from an empty pipeline and its flush;
two calls in a row and their flush), cuts it per call, and hands out call t's actions with their microbatches shifted:
the steady call repeats with period m (a test holds that against a longer lowering). Every
message is received in the call that sends it: a gradient sent across a call's end is posted for
receipt at the end of the sender's call, and consumed in the next.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from mesh3d.pipeline.schedule.communicators import RUNTIME, Communicators
from mesh3d.pipeline.schedule.generators import one_f_one_b
from mesh3d.pipeline.schedule.ir import COMPUTE, Action, Kind, Schedule, ScheduleError
from mesh3d.pipeline.schedule.lower import Message, _message_of, check_lists, lower
from mesh3d.pipeline.schedule.timeline import timeline

NEVER_DRAIN = ("pipedream", "pipedream_2bw")


@dataclass(frozen=True)
class UpdateRule:
    """Which weights each microbatch sees, and when each stage updates (see the module docstring)."""

    schedule: str  # one of NEVER_DRAIN
    pp: int
    microbatches: int  # per call

    def completes_update(self, microbatch: int) -> bool:
        """Whether this microbatch's backward is the last before its stage's update."""
        return self.schedule == "pipedream" or microbatch % self.microbatches == self.microbatches - 1

    def update_index(self, microbatch: int) -> int:
        """The update this microbatch's gradient goes into (0, 1, 2, ... per stage)."""
        return microbatch if self.schedule == "pipedream" else microbatch // self.microbatches

    def version(self, stage: int, microbatch: int) -> int:
        """How many of stage's updates the weights this microbatch's forward and backward use have."""
        if self.schedule == "pipedream":
            return max(0, microbatch - (self.pp - stage) + 1)
        return max(0, microbatch // self.microbatches - 1)

    def most_versions(self, stage: int) -> int:
        """Weight versions stage holds at once in the steady state (its live weights included)."""
        return self.pp - stage if self.schedule == "pipedream" else 2


def continuous_schedule(schedule: str, pp: int, microbatches: int, calls: int) -> Schedule:
    """The compute order of `calls` calls in a row: 1F1B over calls * microbatches microbatches."""
    if schedule not in NEVER_DRAIN:
        raise ValueError(f"{schedule!r} is not a never-drain schedule; choose one of {list(NEVER_DRAIN)}")
    built = one_f_one_b(pp, calls * microbatches)
    return replace(built, name=schedule)


def never_drain(schedule: str):
    """The catalog's generator for a never-drain schedule: one call from an empty pipeline with its
    flush (what draws and plain simulations show; `simulate(..., calls=K)` shows K in a row)."""

    def generate(pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
        return continuous_schedule(schedule, pp, microbatches, 1)

    generate.__name__ = schedule
    return generate


def _call_of_compute(rule: UpdateRule, rank: int, action: Action) -> int:
    """The call a compute action of rank `rank` runs in; a backward past its call's cut belongs to
    the next call (or, after the last call, to the flush: index `calls`)."""
    m, pp = rule.microbatches, rule.pp
    batch = action.microbatch // m
    if action.kind == Kind.F:
        return batch
    # Rank r's cut follows the backward of microbatch (t+1)*m - pp + r: its last backward of call t.
    last_in_call = (batch + 1) * m - pp + rank
    return batch if action.microbatch <= last_in_call else batch + 1


@dataclass(frozen=True)
class StreamLowering:
    """A lowered stream of `calls` calls, cut: segments[rank][c] is what rank runs in call c
    (c = calls: the flush)."""

    rule: UpdateRule
    calls: int
    segments: tuple[tuple[tuple[Action, ...], ...], ...]


def lower_stream(
    rule: UpdateRule,
    calls: int,
    ties: tuple[tuple[int, ...], ...] = (),
    communicators: Communicators = RUNTIME,
) -> StreamLowering:
    """Lower `calls` calls in a row, add the updates, cut per call, and check the cut lists finish
    call by call with `communicators` (each call's messages complete within it; compute may use
    what earlier calls did).

    `ties`: the stages holding a copy of each tied weight (see `_add_tie_updates`)."""
    schedule = continuous_schedule(rule.schedule, rule.pp, rule.microbatches, calls)
    lowered = lower(schedule, communicators=communicators)
    # Which call each message belongs to: its sender's.
    message_call: dict[Message, int] = {}
    for rank, actions in enumerate(lowered.actions):
        current = 0
        for action in actions:
            if action.kind in COMPUTE:
                current = _call_of_compute(rule, rank, action)
            elif action.kind in (Kind.SEND_F, Kind.SEND_B):
                message_call[_message_of(action)] = current
    segments = []
    for rank, actions in enumerate(lowered.actions):
        parts: list[list[Action]] = [[] for _ in range(calls + 1)]
        current = 0
        early: list[list[Action]] = [[] for _ in range(calls + 1)]  # receives moved to their call's start
        for action in actions:
            if action.kind in COMPUTE:
                current = _call_of_compute(rule, rank, action)
                parts[current].append(action)
                if action.kind == Kind.B and rule.completes_update(action.microbatch):
                    parts[current].append(Action(action.stage, Kind.U, action.microbatch))
            elif action.kind in (Kind.RECV_F, Kind.RECV_B):
                sent_in = message_call[_message_of(action)]
                if sent_in < current:
                    parts[sent_in].append(action)  # posted before the sender's call ends
                elif sent_in > current:
                    early[sent_in].append(action)
                else:
                    parts[current].append(action)
            else:
                parts[current].append(action)
        segments.append([early[c] + _updates_after_sends(parts[c]) for c in range(calls + 1)])
    if ties:
        timed = timeline(schedule)
        starts = {t.action: t.start for t in timed}
        ends = {t.action: t.end for t in timed}
        for holders in ties:
            _add_tie_updates(segments, sorted(holders), starts, ends)
    stream = StreamLowering(rule, calls, tuple(tuple(tuple(part) for part in parts) for parts in segments))
    _check_call_by_call(schedule, stream, communicators)
    return stream


def _add_tie_updates(
    segments: list[list[list[Action]]], holders: list[int], start: dict[Action, float], end: dict[Action, float]
) -> None:
    """A weight tied across stages follows the rule of its first stage (the primary), on every copy
    at once: a TIE joins the primary's update (right before its U, which then applies the summed
    gradient) with each other holder's update of its copy. Every holder reaches it at the moment
    the primary finishes the backward completing the update (in the simulated timeline, `start` and
    `end` of each compute action), in the primary's call: by then each holder's own share of the
    gradient is done, none of its forwards needing the new version has started, and every list
    stays in time order, which is what makes the lowering finish. (Stage s runs on pp rank s:
    these schedules hold one stage per rank.)"""
    primary, secondaries = holders[0], holders[1:]
    moments: list[tuple[int, float, int]] = []  # (call, moment, microbatch) of each update
    for call, part in enumerate(segments[primary]):
        updated = []
        for action in part:
            if action.kind == Kind.U:
                moments.append((call, end[Action(primary, Kind.B, action.microbatch)], action.microbatch))
                updated.append(Action(primary, Kind.TIE, action.microbatch))
            updated.append(action)
        part[:] = updated
    for stage in secondaries:
        for call, moment, microbatch in moments:
            part = segments[stage][call]
            later = next((i for i, a in enumerate(part) if a.kind in COMPUTE and start[a] >= moment), len(part))
            part.insert(later, Action(stage, Kind.TIE, microbatch))


def _updates_after_sends(actions: list[Action]) -> list[Action]:
    """Move each update past the messages that follow its backward: the gradient goes out first."""
    out: list[Action] = []
    pending: list[Action] = []
    for action in actions:
        if action.kind == Kind.U:
            pending.append(action)
        elif action.kind not in COMPUTE and pending:
            out.append(action)
        else:
            out += pending
            pending = []
            out.append(action)
    return out + pending


def _check_call_by_call(schedule: Schedule, stream: StreamLowering, communicators: Communicators) -> None:
    done: set[Action] = set()
    completed: set[Message] = set()
    for c in range(stream.calls + 1):
        lists = [segments[c] for segments in stream.segments]
        try:
            check_lists(schedule, lists, (), done, completed, communicators)
        except ScheduleError as error:
            raise ScheduleError(f"{schedule.name}, call {c} of {stream.calls}: {error}") from None
    expected = {Action(a.stage, a.kind, a.microbatch) for acts in schedule.actions for a in acts}
    if done != expected:
        raise ScheduleError(f"{schedule.name}: the cut stream leaves {len(expected - done)} compute actions out")


def shifted(actions: tuple[Action, ...], microbatches: int) -> tuple[Action, ...]:
    """The same actions `microbatches` microbatches later (a later call of the same pattern)."""
    if microbatches == 0:
        return actions
    return tuple(replace(a, microbatch=a.microbatch + microbatches) for a in actions)


class NeverDrainStream:
    """Call t's actions on one rank, from two small lowerings (see the module docstring)."""

    def __init__(self, rule: UpdateRule, ties: tuple[tuple[int, ...], ...] = ()):
        self.rule = rule
        self.ties = ties
        self.alone = lower_stream(rule, 1, ties)  # a call from an empty pipeline, then its flush
        self.pair = lower_stream(rule, 2, ties)  # ... and a call behind another

    def call(self, rank: int, index: int, behind_another: bool) -> tuple[Action, ...]:
        """Rank's actions for call `index` (microbatches index*m ...), filling the pipeline, or
        `behind_another` call whose backwards are still in flight."""
        m = self.rule.microbatches
        if behind_another:
            return shifted(self.pair.segments[rank][1], (index - 1) * m)
        return shifted(self.alone.segments[rank][0], index * m)

    def flush(self, rank: int, last_call: int, behind_another: bool) -> tuple[Action, ...]:
        """Rank's actions finishing what call `last_call` left in flight (it ran `behind_another` or not)."""
        m = self.rule.microbatches
        if behind_another:
            return shifted(self.pair.segments[rank][2], (last_call - 1) * m)
        return shifted(self.alone.segments[rank][1], last_call * m)


@functools.lru_cache(maxsize=32)
def never_drain_stream(
    schedule: str, pp: int, microbatches: int, ties: tuple[tuple[int, ...], ...] = ()
) -> NeverDrainStream:
    """The stream of a never-drain schedule (cached: every rank and every parallelize reuses it);
    `ties`: the stages holding a copy of each weight tied across stages."""
    return NeverDrainStream(UpdateRule(schedule, pp, microbatches), ties)


__all__ = [
    "NEVER_DRAIN",
    "NeverDrainStream",
    "UpdateRule",
    "continuous_schedule",
    "lower_stream",
    "never_drain",
    "never_drain_stream",
    "shifted",
]
