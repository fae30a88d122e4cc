"""Lowering: a compute schedule plus its communication, and the check that the result can finish.

- `lower()` inserts SEND/RECV actions. Every rank lists its messages in the order of the
  simulated send times (from `timeline()`, ties broken by one global key), so the two ends of
  every rank pair see their shared messages in the same order (gloo also matches them by tag).
  Skip connections (a stage whose output some stage past the next one consumes) get their own
  messages, straight from producer to consumer and back for the gradient, never relayed through
  the stages between (torchgpipe's portals): the consumer's forward already waits for the
  producer's through the chain, and the producer's backward for the consumer's, so they add
  messages but no ordering.
- `check_lowered()` replays the lowered lists with only their order (no costs), under NCCL's
  rule: each communicator's operations complete in issue order (one stream), a collective behind
  every earlier one (schedule/communicators.py says which communicator each uses). It requires
  every rank to reach its end: a lowered schedule that passes runs under any real timing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from mesh3d.pipeline.schedule.communicators import RUNTIME, Communicators
from mesh3d.pipeline.schedule.ir import BACKWARD_INPUT, COMMUNICATION, COMPUTE, Action, Kind, Schedule, ScheduleError
from mesh3d.pipeline.schedule.timeline import dependencies, replay, timeline


@dataclass(frozen=True)
class Message:
    """An activation (SEND_F) or gradient (SEND_B) going from one stage to another: the next /
    previous one, or, across a skip connection, a later / earlier one."""

    kind: Kind  # SEND_F or SEND_B
    stage: int  # the stage that produces it
    microbatch: int
    consumer_stage: int


@dataclass(frozen=True)
class LoweredSchedule:
    """A schedule with its communication: what each rank runs, in order."""

    schedule: Schedule
    actions: tuple[tuple[Action, ...], ...]
    skips: tuple[tuple[int, int], ...] = ()  # (producer, consumer) stage pairs past the adjacent ones

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions))


def _message_of(action: Action) -> Message:
    """The message a SEND/RECV action carries, keyed by its producer."""
    if action.kind in (Kind.SEND_F, Kind.SEND_B):
        return Message(action.kind, action.stage, action.microbatch, action.other_stage)
    kind = Kind.SEND_F if action.kind == Kind.RECV_F else Kind.SEND_B
    return Message(kind, action.other_stage, action.microbatch, action.stage)


def check_skips(skips, n_stages: int) -> tuple[tuple[int, int], ...]:
    """Skip connections as sorted (producer, consumer) pairs, each past the next stage."""
    pairs = tuple(sorted({(int(p), int(c)) for p, c in skips}))
    for producer, consumer in pairs:
        if not 0 <= producer < consumer - 1 < n_stages - 1:
            raise ScheduleError(
                f"skip connection {(producer, consumer)}: a skip goes from a stage to one past the next, "
                f"within stages 0..{n_stages - 1}"
            )
    return pairs


def consumers(stage: int, n_stages: int, skips: tuple[tuple[int, int], ...]) -> list[int]:
    """The stages that take `stage`'s output: the next one, then the skips' consumers."""
    nxt = [stage + 1] if stage < n_stages - 1 else []
    return nxt + [c for p, c in skips if p == stage]


def producers(stage: int, skips: tuple[tuple[int, int], ...]) -> list[int]:
    """The stages whose output `stage` takes: the previous one, then the skips' producers."""
    return ([stage - 1] if stage > 0 else []) + [p for p, c in skips if c == stage]


def lower(schedule: Schedule, skips=(), communicators: Communicators = RUNTIME) -> LoweredSchedule:
    """Add SEND after each compute whose result another rank needs, RECV before its use; then check
    the lists finish with `communicators` (schedule/communicators.py).

    `skips`: (producer, consumer) stage pairs of skip connections, consumer past producer + 1."""
    timed = timeline(schedule)
    n_stages = schedule.n_stages
    skips = check_skips(skips, n_stages)
    # (time, 0 for communication / 1 for compute, global tie-break) -> same message order on both ends.
    keyed: list[list[tuple]] = [[] for _ in range(schedule.pp)]
    for item in timed:
        action, rank = item.action, item.rank
        keyed[rank].append((item.start, 1, (), action))
        if action.kind == Kind.F:
            kind, targets = Kind.SEND_F, consumers(action.stage, n_stages, skips)
        elif action.kind in BACKWARD_INPUT:
            kind, targets = Kind.SEND_B, producers(action.stage, skips)
        else:
            continue
        for target in targets:
            peer = schedule.stage_rank(target)
            if peer == rank:
                continue  # both stages on this rank: handed over in memory
            adjacent = abs(target - action.stage) == 1
            tie_break = (action.stage, kind.value, action.microbatch, target)
            send = Action(action.stage, kind, action.microbatch, peer, None if adjacent else target)
            keyed[rank].append((item.end, 0, tie_break, send))
            recv_kind = Kind.RECV_F if kind == Kind.SEND_F else Kind.RECV_B
            recv = Action(target, recv_kind, action.microbatch, rank, None if adjacent else action.stage)
            keyed[peer].append((item.end, 0, tie_break, recv))
    actions = tuple(tuple(entry[-1] for entry in sorted(entries, key=lambda e: e[:3])) for entries in keyed)
    lowered = LoweredSchedule(schedule, actions, skips)
    check_lowered(lowered, communicators)
    return lowered


def check_lowered(lowered: LoweredSchedule, communicators: Communicators = RUNTIME) -> None:
    """Replay the lowered lists by order alone and raise ScheduleError if any rank cannot finish.

    The model is NCCL's (schedule/communicators.py): each rank runs its list in order; SEND and
    RECV are issued without blocking the rank, but the operations a rank issued on one
    communicator complete one after the other, in issue order, each only when the other end has
    issued its half; a compute waits for the messages it consumes. Lists that finish here also
    finish with gloo and under any finer assignment of communicators, whatever the timing.
    """
    check_lists(lowered.schedule, lowered.actions, lowered.skips, communicators=communicators)


def check_lists(
    schedule: Schedule,
    actions_per_rank,
    skips: tuple[tuple[int, int], ...] = (),
    done: set[Action] | None = None,
    completed: set[Message] | None = None,
    communicators: Communicators = RUNTIME,
) -> None:
    """check_lowered's replay over any per-rank lists of `schedule`'s actions (a never-drain
    schedule's one call among several: `done` and `completed` carry the compute actions and
    messages earlier calls finished, and gain this one's). An update (U) runs whenever reached; a
    tied weight's update (TIE) is a collective on its communicator: the rank waits in it until
    every rank listing a TIE of the same microbatch has it at the head of that communicator's
    queue, behind every operation the rank issued there before."""
    n_stages = schedule.n_stages
    _check_same_order(actions_per_rank, communicators)
    collective: dict[int, set[int]] = defaultdict(set)  # TIE microbatch -> the ranks that list it
    for rank, actions in enumerate(actions_per_rank):
        for action in actions:
            if action.kind == Kind.TIE:
                collective[action.microbatch].add(rank)
    tie_channel = {j: communicators.of_tie(frozenset(ranks), schedule.pp) for j, ranks in collective.items()}
    queues: dict[tuple[int, tuple], list[Action]] = defaultdict(list)  # (rank, communicator) -> issued
    head: dict[tuple[int, tuple], int] = defaultdict(int)  # per queue: the first not yet completed
    ties_done: set[tuple[int, int]] = set()  # (rank, microbatch) of each TIE completed
    completed = set() if completed is None else completed
    done = set() if done is None else done

    def channel(rank: int, action: Action) -> tuple:
        if action.kind == Kind.TIE:
            return tie_channel[action.microbatch]
        return communicators.of_message(rank, action)

    def at_head(rank: int, key: tuple) -> Action | None:
        queue = queues.get((rank, key), ())
        return queue[head[(rank, key)]] if head[(rank, key)] < len(queue) else None

    def advance(rank: int, key: tuple) -> None:
        head[(rank, key)] += 1
        moved.add((rank, key))

    moved: set[tuple[int, tuple]] = set()  # queues issued to or advanced since the last settle

    def settle() -> None:
        while moved:
            rank, key = moved.pop()
            action = at_head(rank, key)
            if action is None:
                continue
            if action.kind == Kind.TIE:
                members = collective[action.microbatch]
                if all(at_head(r, key) == action for r in members):
                    for r in members:
                        advance(r, key)
                        ties_done.add((r, action.microbatch))
                continue
            other = at_head(action.peer, key)
            if other is not None and other.kind != Kind.TIE and _message_of(other) == _message_of(action):
                completed.add(_message_of(action))
                advance(rank, key)
                advance(action.peer, key)

    def run(rank: int, action: Action) -> bool:
        if action.kind in COMPUTE:
            needed = dependencies(action, n_stages)
            if any(d not in done for d in needed if schedule.stage_rank(d.stage) == rank):
                return False
            if any(m not in completed for m in _messages_needed(action, schedule, rank, skips)):
                return False
            done.add(action)
        elif action.kind in COMMUNICATION:
            key = channel(rank, action)
            queues[(rank, key)].append(action)
            moved.add((rank, key))
        elif action.kind == Kind.TIE:
            if (rank, action.microbatch) in ties_done:
                return True
            key = channel(rank, action)
            issued = Action(-1, Kind.TIE, action.microbatch)  # every holder's TIE is one collective
            if issued not in queues[(rank, key)][head[(rank, key)] :]:
                queues[(rank, key)].append(issued)
                moved.add((rank, key))
                settle()  # the last holder to arrive completes it at once
            return (rank, action.microbatch) in ties_done
        return True

    # Matching after every rank's turn lets the next rank see the operations this one just issued.
    stuck = replay(actions_per_rank, run, after_each_rank=settle)
    pending = [(r, a) for (r, key) in queues if (a := at_head(r, key)) is not None]
    if stuck or pending:
        where = "; ".join(f"rank {r} stuck at {a}" for r, a in stuck)
        unmatched = ", ".join(f"{a} on rank {r}" for r, a in pending)
        if where and unmatched:
            where += f" (at the head of their communicators: {unmatched})"
        where = where or "operations never matched: " + unmatched
        raise ScheduleError(
            f"lowered schedule {schedule.name!r} cannot finish with {communicators} (NCCL's order): {where}"
        )


def _check_same_order(actions_per_rank, communicators: Communicators) -> None:
    """The two ends of each pair list their shared messages on each communicator in one order
    (NCCL pairs them by that order)."""
    pair_order: dict[tuple, list[list[Message]]] = defaultdict(lambda: [[], []])
    for rank, actions in enumerate(actions_per_rank):
        for action in actions:
            if action.kind in COMMUNICATION:
                pair = (min(rank, action.peer), max(rank, action.peer))
                key = (communicators.of_message(rank, action), *pair)
                pair_order[key][0 if rank == pair[0] else 1].append(_message_of(action))
    for (_, low, high), (seen_low, seen_high) in pair_order.items():
        if seen_low != seen_high:
            raise ScheduleError(f"ranks {low} and {high} list their messages in different orders")


def _messages_needed(
    action: Action, schedule: Schedule, rank: int, skips: tuple[tuple[int, int], ...]
) -> list[Message]:
    """The messages from other ranks a compute action consumes: F its inputs, B / I its output gradients."""
    s, j = action.stage, action.microbatch
    if action.kind == Kind.F:
        sources, kind = producers(s, skips), Kind.SEND_F
    elif action.kind in BACKWARD_INPUT:
        sources, kind = consumers(s, schedule.n_stages, skips), Kind.SEND_B
    else:
        return []
    return [Message(kind, source, j, s) for source in sources if schedule.stage_rank(source) != rank]
