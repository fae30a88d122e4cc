"""Lowering: a compute schedule plus its communication, and the check that the result can finish.

- `lower()` inserts SEND/RECV actions. Every rank lists its messages in the order of the
  simulated send times (from `timeline()`, ties broken by one global key), so the two ends of
  every rank pair see their shared messages in the same order (gloo also matches them by tag).
- `check_lowered()` replays the lowered lists with only their order (no costs), with each
  rank's communication completing in issue order (NCCL, one stream), and requires every rank to
  reach its end. A lowered schedule that passes runs under any real timing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from mesh3d.pipeline.schedule.ir import BACKWARD_INPUT, COMPUTE, Action, Kind, Schedule, ScheduleError
from mesh3d.pipeline.schedule.timeline import dependencies, replay, timeline


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
        elif action.kind in BACKWARD_INPUT and action.stage > 0:
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

    def run(rank: int, action: Action) -> bool:
        if action.kind in COMPUTE:
            needed = dependencies(action, n_stages)
            if any(d not in done for d in needed if schedule.stage_rank(d.stage) == rank):
                return False
            remote = [d for d in needed if schedule.stage_rank(d.stage) != rank]
            if any(_produced_message(d) not in completed for d in remote):
                return False
            done.add(action)
        else:
            issued[rank].append(action)
        return True

    # Matching after every rank's turn lets the next rank see the messages this one just issued.
    stuck = replay(lowered.actions, run, after_each_rank=settle)
    pending = [issued[r][head[r]] for r in range(schedule.pp) if head[r] < len(issued[r])]
    if stuck or pending:
        where = "; ".join(f"rank {r} stuck at {a}" for r, a in stuck)
        raise ScheduleError(
            f"lowered schedule {schedule.name!r} cannot finish: {where or 'operations never matched: ' + ', '.join(map(str, pending))}"
        )


def _produced_message(dependency: Action) -> Message:
    kind = Kind.SEND_F if dependency.kind == Kind.F else Kind.SEND_B
    return Message(kind, dependency.stage, dependency.microbatch)
