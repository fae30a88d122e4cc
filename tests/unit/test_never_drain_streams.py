"""The never-drain schedules as data: their streams lower and finish call by call, repeat with the
period of one call, keep the update rule the docs state, and simulate without a bubble in the
steady state.

For pp 1-8 and m in {pp, pp+1, 2pp}, with and without a tie: four calls lowered in one piece cut
into the lists the runtime builds from its two small lowerings (each call's lists finish on their
own); every F and B once, each U right after the backward completing it; PipeDream's versions are
the updates run before each forward; TIEs pair up in the same call, after the holder's backward
and before its forwards of the new version; K calls take K*m + p - 1 slots (1F1B: K*(m + p - 1));
a call ends one forward later per rank.
"""

import pytest

from mesh3d.pipeline import simulate
from mesh3d.pipeline.schedule.catalog import build_schedule
from mesh3d.pipeline.schedule.ir import Kind
from mesh3d.pipeline.schedule.never_drain import (
    NEVER_DRAIN,
    NeverDrainStream,
    UpdateRule,
    continuous_schedule,
    lower_stream,
)
from mesh3d.pipeline.schedule.timeline import timeline

SIZES = [(pp, m) for pp in range(1, 9) for m in sorted({pp, pp + 1, 2 * pp})]


@pytest.mark.parametrize("schedule", NEVER_DRAIN)
@pytest.mark.parametrize("pp,m", SIZES)
@pytest.mark.parametrize("tied", [False, True])
def test_stream_repeats_call_after_call(schedule, pp, m, tied):
    """Four calls lowered in one piece cut into the same lists the runtime builds from two small
    lowerings (a call from an empty pipeline, a call behind another, the flush), shifted; with a
    weight tied between the first and the last stage (and, from pp = 3, a middle one too), the
    TIE collectives included."""
    rule = UpdateRule(schedule, pp, m)
    ties = () if not tied or pp == 1 else ((0, pp // 2, pp - 1),) if pp >= 3 else ((0, 1),)
    four = lower_stream(rule, 4, ties)  # raises if any call's lists could not finish
    stream = NeverDrainStream(rule, ties)
    for rank in range(pp):
        assert four.segments[rank][0] == stream.call(rank, 0, behind_another=False)
        for call in (1, 2, 3):
            assert four.segments[rank][call] == stream.call(rank, call, behind_another=True)
        assert four.segments[rank][4] == stream.flush(rank, 3, behind_another=True)


@pytest.mark.parametrize("schedule", NEVER_DRAIN)
def test_every_action_once_and_updates_where_the_rule_says(schedule):
    pp, m, calls = 4, 5, 3
    stream = lower_stream(UpdateRule(schedule, pp, m), calls)
    for rank in range(pp):
        actions = [a for segment in stream.segments[rank] for a in segment]
        for kind in (Kind.F, Kind.B):
            assert sorted(a.microbatch for a in actions if a.kind == kind) == list(range(calls * m))
        updates = [a.microbatch for a in actions if a.kind == Kind.U]
        expected = list(range(calls * m)) if schedule == "pipedream" else [t * m + m - 1 for t in range(calls)]
        assert updates == expected
        # each update right after the backward completing it (messages may sit between)
        compute = [a for a in actions if a.kind in (Kind.F, Kind.B, Kind.U)]
        for i, action in enumerate(compute):
            if action.kind == Kind.U:
                assert compute[i - 1] == type(action)(action.stage, Kind.B, action.microbatch)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6])
def test_pipedream_versions_are_the_updates_before_the_forward(pp):
    """The rule "weights after the updates of microbatches 0 .. k-(p-s)" is exactly what the stage
    has applied when k's forward runs in the 1F1B order; a backward uses its forward's version."""
    m, calls = pp + 1, 3
    rule = UpdateRule("pipedream", pp, m)
    stream = lower_stream(rule, calls)
    for rank in range(pp):
        applied = 0
        for action in (a for segment in stream.segments[rank] for a in segment):
            if action.kind == Kind.U:
                applied += 1
            elif action.kind == Kind.F:
                assert rule.version(rank, action.microbatch) == applied


def test_tie_updates_pair_up_between_the_updates_they_join():
    """Each update of the first stage has one TIE on every holder, in the same call; a secondary's
    TIE comes after its own backward of the completing microbatch and before any forward that
    needs the new version."""
    pp, m = 4, 4
    for schedule in NEVER_DRAIN:
        rule = UpdateRule(schedule, pp, m)
        stream = lower_stream(rule, 3, ((0, pp - 1),))
        for call in range(4):
            first = [a.microbatch for a in stream.segments[0][call] if a.kind == Kind.TIE]
            last = [a.microbatch for a in stream.segments[pp - 1][call] if a.kind == Kind.TIE]
            assert first == last
        applied = 0
        done_backwards = set()
        for action in (a for part in stream.segments[pp - 1] for a in part):
            if action.kind == Kind.B:
                done_backwards.add(action.microbatch)
            elif action.kind == Kind.TIE:
                assert action.microbatch in done_backwards
                applied += 1
            elif action.kind == Kind.F:
                assert rule.version(0, action.microbatch) <= applied


def test_two_bw_rule_and_versions():
    rule = UpdateRule("pipedream_2bw", 4, 4)
    assert [rule.version(s, k) for s in (0, 3) for k in (0, 3, 4, 7, 8, 12)] == [0, 0, 0, 0, 1, 2] * 2
    assert rule.most_versions(0) == 2 and UpdateRule("pipedream", 4, 4).most_versions(1) == 3


@pytest.mark.parametrize("schedule", NEVER_DRAIN)
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 5), (4, 4), (4, 8), (3, 7)])
def test_calls_in_a_row_take_km_plus_p_minus_1_slots(schedule, pp, m):
    """K calls of m microbatches take (K*m + p - 1) slots of f + b; a schedule that drains takes
    K*(m + p - 1)."""
    f, b = 1.0, 2.0
    for calls in range(1, 5):
        report = simulate(schedule, pp, m, calls=calls, f_cost=f, b_cost=b)
        assert report.makespan == pytest.approx((calls * m + pp - 1) * (f + b))
        drains = simulate("1f1b", pp, m, calls=calls, f_cost=f, b_cost=b)
        assert drains.makespan == pytest.approx(calls * (m + pp - 1) * (f + b))


@pytest.mark.parametrize("pp,m", [(2, 3), (4, 4), (4, 9), (6, 6)])
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0)])
def test_a_call_ends_one_forward_later_per_rank(pp, m, f, b):
    """In the stream, rank r reaches the end of call t r forwards after rank 0 (the batch's last
    microbatch still travels to the loss): what the call's closing collective makes rank 0 wait,
    (p-1)*f per call, against (p-1)*(f+b) for a flush (docs/pipeline.md#never-drain-schedules)."""
    stream = lower_stream(UpdateRule("pipedream_2bw", pp, m), 3)
    ends = {
        (e.rank, e.action): e.end for e in timeline(continuous_schedule("pipedream_2bw", pp, m, 3), f_cost=f, b_cost=b)
    }
    for call in range(3):
        last = []
        for rank in range(pp):
            compute = [a for a in stream.segments[rank][call] if a.kind in (Kind.F, Kind.B)]
            last.append(ends[(rank, compute[-1])])
        assert [t - last[0] for t in last] == [r * f for r in range(pp)], (call, last)


def test_refusals():
    with pytest.raises(ValueError, match="microbatches >= pp"):
        build_schedule("pipedream_2bw", 4, 3)
    with pytest.raises(ValueError, match="one stage per rank"):
        build_schedule("pipedream", 2, 4, 2)
    with pytest.raises(ValueError, match="calls must be a positive integer"):
        simulate("pipedream", 2, 2, calls=0)
