"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

Each backward is split in two: I, the gradient with respect to the stage's input, which the
previous stage waits for; and W, the gradient with respect to the stage's weights, which nobody
waits for. W's can then fill what would be bubbles. An activation stays live until its W has run.

The generators play the schedule with unit costs (F = I = W = 1). ZB-H1 and interleaved zero
bubble let each rank run a waiting W whenever its next F or I cannot start (its input has not
arrived, or it holds as many activations as it may); ZBV lists each W next to its I and leaves
W's to the waits only in the cooldown:

- `zero_bubble_h1` (ZB-H1): 1F1B's order of F and I, at most pp live activations. Bubble
  (pp-1)/(3m+pp-1) with f = i = w, a third of 1F1B's.
- `interleaved_zero_bubble` (v stages per rank, loop placement): interleaved 1F1B's order of F
  and I with W's in the waits, at most one live activation more than interleaved 1F1B holds. A
  greedy order (the ready I of the earliest microbatch, else a ready F, else a waiting W) has a
  lower bubble when W costs as much as I (pp=4, m=8: 5.9 % against 9.4 %), but it keeps I's
  back-to-back and W's for later, so when I costs more than W, as on real blocks, it loses the
  gain (16.2 % against 11.4 % with w = 0.7; worse than interleaved 1F1B at pp=8). Taking the
  worse of w = 1, 0.7 and 0.4, 1F1B's order is the better one for every pp <= 8 and m <= 4pp.
- `zero_bubble_v` (ZB-V: 2 stages per rank in a V, rank r holds stages r and 2pp-1-r, so the
  first and last stage share rank 0): the paper's V pattern. Rank r first runs 2(pp-r)-1 forwards
  of its down stage (r), then r pairs (a forward of its up stage 2pp-1-r, then one of the down
  stage), then pp-r triples of its up stage (F, I, W), then alternates triples of the down and
  the up stage until its forwards are done; in the cooldown the ready I of the earliest
  microbatch goes first and W's fill the waits. An I followed at once by its own W takes the
  time of a whole backward whatever the split between them, so the order keeps its timing when
  I costs more than W, as it does on real blocks (the attention's backward is all I; see
  docs/pipeline.md). A greedy order played with F = I = W (ready I, else F, else W) has the
  same bubble with w = 1, but 24 % against 7.5 % with I = 1.3, W = 0.7 (pp = 4, m = 8).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from mesh3d.pipeline.schedule.generators import interleaved_one_f_one_b, one_f_one_b
from mesh3d.pipeline.schedule.ir import Action, Kind, Schedule, ScheduleError

# A rank's policy: (rank, time, ready(action) -> bool, live activations, waiting W's) -> the action
# to start now, or None to let the rank wait for the next event.
Policy = Callable[[int, float, Callable[[Action], bool], int, list], "Action | None"]


def zero_bubble_h1(pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    base = one_f_one_b(pp, microbatches)
    actions = _play("zero_bubble", pp, microbatches, 1, "loop", _follow(base, limits=[pp] * pp))
    return Schedule("zero_bubble", pp, microbatches, 1, actions)


def interleaved_zero_bubble(pp: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    base = interleaved_one_f_one_b(pp, microbatches, virtual_stages)
    limits = [_peak(acts) + 1 for acts in base.actions]
    actions = _play("zero_bubble", pp, microbatches, virtual_stages, "loop", _follow(base, limits))
    return Schedule("zero_bubble", pp, microbatches, virtual_stages, actions)


def zero_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """ZB-H1 with one stage per rank, interleaved zero bubble with more."""
    if virtual_stages == 1:
        return zero_bubble_h1(pp, microbatches)
    return interleaved_zero_bubble(pp, microbatches, virtual_stages)


def zero_bubble_v(pp: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    if virtual_stages != 2:
        raise ValueError(f"schedule 'zbv' places exactly 2 stages per rank in a V, got virtual_stages={virtual_stages}")
    patterns = [_v_pattern(pp, microbatches, rank) for rank in range(pp)]
    actions = _play("zbv", pp, microbatches, 2, "v", _follow_then_inputs_first(pp, microbatches, patterns))
    return Schedule("zbv", pp, microbatches, 2, actions, placement="v")


def _v_pattern(pp: int, microbatches: int, rank: int) -> list[Action]:
    """Rank `rank`'s ZB-V order up to its last forward (with that forward's I and W): warm-up
    forwards of the down stage, pairs of up and down forwards, then (F, I, W) triples."""
    down, up = rank, 2 * pp - 1 - rank
    forwards, backwards = {down: 0, up: 0}, {down: 0, up: 0}
    order: list[Action] = []

    def forward(stage: int) -> None:
        if forwards[stage] < microbatches:
            order.append(Action(stage, Kind.F, forwards[stage]))
            forwards[stage] += 1

    def backward(stage: int) -> None:  # I and, at once, its W
        if backwards[stage] < forwards[stage]:
            order.extend([Action(stage, Kind.I, backwards[stage]), Action(stage, Kind.W, backwards[stage])])
            backwards[stage] += 1

    for _ in range(2 * (pp - rank) - 1):
        forward(down)
    for _ in range(rank):
        forward(up)
        forward(down)
    for _ in range(pp - rank):
        forward(up)
        backward(up)
    while forwards[down] < microbatches or forwards[up] < microbatches:
        for stage in (down, up):
            forward(stage)
            backward(stage)
    return order


def _follow_then_inputs_first(pp: int, microbatches: int, patterns: list[list[Action]]) -> Policy:
    """Each rank runs its pattern in order (waiting when the next cannot start); after it, the
    ready I of the earliest microbatch (later stage first), else a waiting W."""
    position = [0] * pp
    # A stage runs its inputs' backwards in microbatch order, so the only I of a stage that can be
    # ready is the one after those it ran: counted here (every action a rank runs comes from here).
    inputs_run = [0] * (2 * pp)

    def run(action: Action) -> Action:
        if action.kind == Kind.I:
            inputs_run[action.stage] += 1
        return action

    def policy(rank: int, now: float, ready, live: int, waiting: list) -> Action | None:
        pattern = patterns[rank]
        if position[rank] < len(pattern):
            nxt = pattern[position[rank]]
            if nxt in waiting if nxt.kind == Kind.W else ready(nxt):
                position[rank] += 1
                return run(nxt)
            return None
        candidates = [
            Action(s, Kind.I, inputs_run[s]) for s in (rank, 2 * pp - 1 - rank) if inputs_run[s] < microbatches
        ]
        ready_inputs = [a for a in candidates if ready(a)]
        if ready_inputs:
            return run(min(ready_inputs, key=lambda a: (a.microbatch, -a.stage)))
        return waiting[0] if waiting else None

    return policy


def _follow(base: Schedule, limits: list[int]) -> Policy:
    """Run `base`'s forwards and backwards (as I) in its order; a W when the next cannot start."""
    order = [
        [Action(a.stage, Kind.I if a.kind == Kind.B else a.kind, a.microbatch) for a in acts] for acts in base.actions
    ]
    position = [0] * base.pp

    def policy(rank: int, now: float, ready, live: int, waiting: list) -> Action | None:
        if position[rank] < len(order[rank]):
            nxt = order[rank][position[rank]]
            if ready(nxt) and (nxt.kind != Kind.F or live < limits[rank]):
                position[rank] += 1
                return nxt
        return waiting[0] if waiting else None

    return policy


def _peak(actions) -> int:
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == Kind.F else -1
        peak = max(peak, live)
    return peak


def _play(
    name: str, pp: int, microbatches: int, v: int, placement: str, policy: Policy
) -> tuple[tuple[Action, ...], ...]:
    """Event-driven play with unit costs; each rank asks `policy` what to start whenever it is free."""
    n_stages = pp * v
    finished: dict[Action, float] = {}
    free_at = [0.0] * pp
    live = [0] * pp
    waiting: list[list[Action]] = [[] for _ in range(pp)]
    order: list[list[Action]] = [[] for _ in range(pp)]
    total, now, placed = 3 * n_stages * microbatches, 0.0, 0
    events: list[float] = []  # finish times still ahead

    def ready_at(now: float) -> Callable[[Action], bool]:
        def ready(action: Action) -> bool:
            if action in finished:
                return False
            s, j = action.stage, action.microbatch
            if action.kind == Kind.F:
                needs = [Action(s - 1, Kind.F, j)] if s > 0 else []
                if j > 0:
                    needs.append(Action(s, Kind.F, j - 1))  # a stage takes microbatches in order
            else:
                needs = [Action(s, Kind.F, j)] + ([Action(s + 1, Kind.I, j)] if s < n_stages - 1 else [])
                if j > 0:
                    needs.append(Action(s, Kind.I, j - 1))
            return all(finished.get(d, float("inf")) <= now for d in needs)

        return ready

    while placed < total:
        ready = ready_at(now)
        for rank in range(pp):
            if free_at[rank] > now:
                continue
            action = policy(rank, now, ready, live[rank], waiting[rank])
            if action is None:
                continue
            if action.kind == Kind.W:
                waiting[rank].remove(action)
                live[rank] -= 1
            elif action.kind == Kind.I:
                waiting[rank].append(Action(action.stage, Kind.W, action.microbatch))
            else:
                live[rank] += 1
            finished[action] = free_at[rank] = now + 1.0
            order[rank].append(action)
            placed += 1
            heapq.heappush(events, now + 1.0)
        while events and events[0] <= now:
            heapq.heappop(events)
        if not events:
            if placed < total:
                raise ScheduleError(f"{name}: the generator could not place every action (pp={pp}, m={microbatches})")
            break
        now = heapq.heappop(events)
    return tuple(tuple(o) for o in order)
