"""NCCL's rule in the schedule compiler: operations on one communicator complete in issue order, a
collective behind every operation issued on its communicator before it.

With the communicators the runtime creates (one per direction per pair of pp ranks, one per tie)
every schedule of the catalog finishes: pp 2..8, microbatches sampled from pp to 4*pp, skip
connections, DualPipeV, the never-drain streams with a tied weight (the lists the runtime runs).
With the assignment mesh3d had before (every message and, at pp = 2, the TIE on the pp group) the
check finds the deadlock a replay by hand found: pipedream stops in its first call, rank 0 in the
TIE while rank 1 waits for a forward behind it; pipedream_2bw in its first steady call.
"""

import pytest

from mesh3d.pipeline.schedule.catalog import SCHEDULES, build_schedule
from mesh3d.pipeline.schedule.communicators import RUNTIME, SEPARATE, SHARED, message_channels
from mesh3d.pipeline.schedule.ir import Action, Kind, ScheduleError
from mesh3d.pipeline.schedule.lower import check_lists, lower
from mesh3d.pipeline.schedule.never_drain import NEVER_DRAIN, NeverDrainStream, UpdateRule, lower_stream

PPS = range(2, 9)


def microbatches(pp: int, least: int) -> list[int]:
    return sorted(m for m in {pp, pp + 1, 2 * pp, 4 * pp} if m >= least)


VIRTUAL = {"interleaved_1f1b": (1, 2, 3), "zero_bubble": (1, 2), "zbv": (2,), "dualpipev": (2,)}


@pytest.mark.parametrize("name", [n for n, spec in SCHEDULES.items() if not spec.never_drains])
def test_every_schedule_that_drains_finishes_with_the_runtime_communicators(name):
    for pp in PPS:
        for m in microbatches(pp, SCHEDULES[name].min_microbatches(pp)):
            for v in VIRTUAL.get(name, (1,)):
                schedule = build_schedule(name, pp, m, v)
                last = schedule.n_stages - 1
                for skips in ((), ((0, last),)) if last >= 2 else ((),):
                    lower(schedule, skips, communicators=RUNTIME)  # raises ScheduleError if it stops


@pytest.mark.parametrize("name", NEVER_DRAIN)
def test_never_drain_streams_with_a_tie_finish_with_the_runtime_communicators(name):
    """The two lowerings the runtime cuts its calls from (NeverDrainStream checks them as it builds
    them), a weight tied between the first and last stage, and from pp = 3 a middle one too."""
    assert RUNTIME is SEPARATE
    for pp in PPS:
        for m in microbatches(pp, pp):
            for ties in (((0, pp - 1),), ((0, pp // 2, pp - 1),)) if pp >= 3 else (((0, 1),),):
                stream = NeverDrainStream(UpdateRule(name, pp, m), ties)
                assert any(a.kind == Kind.TIE for a in stream.pair.segments[0][1])


@pytest.mark.parametrize(
    "name, m, call, rank_1_waits_for",
    [
        ("pipedream", 3, 0, "RECV_F2@s1<-0"),  # the first call, from m = 3 on
        ("pipedream", 5, 0, "RECV_F2@s1<-0"),
        ("pipedream_2bw", 3, 1, "RECV_F4@s1<-0"),  # the first call behind another
    ],
)
def test_a_tie_on_the_pp_communicator_deadlocks(name, m, call, rank_1_waits_for):
    """The old assignment: at pp = 2 the TIE's group is the pp group (Layout.subgroup of both pp
    ranks), so rank 0's all-reduce waits behind nothing while rank 1's waits behind a forward
    receive whose send rank 0 issues after its TIE."""
    with pytest.raises(ScheduleError) as caught:
        lower_stream(UpdateRule(name, 2, m), 3, ((0, 1),), communicators=SHARED)
    text = str(caught.value)
    assert f"call {call} of 3" in text
    assert "rank 0 stuck at TIE" in text and "rank 1 stuck at TIE" in text
    assert f"{rank_1_waits_for} on rank 1" in text  # the receive ahead of rank 1's TIE
    lower_stream(UpdateRule(name, 2, m), 3, ((0, 1),), communicators=SEPARATE)  # the same lists, ties apart


def test_a_collective_waits_for_what_was_issued_before_it_on_its_communicator():
    """Hand-made: rank 1 posts a receive, then joins the TIE; rank 0 joins the TIE before sending.
    On one communicator that cannot finish; with the TIE on its own it can."""
    schedule = build_schedule("pipedream", 2, 2)
    lists = (
        (Action(0, Kind.TIE, 0), Action(0, Kind.SEND_F, 9, 1)),
        (Action(1, Kind.RECV_F, 9, 0), Action(1, Kind.TIE, 0)),
    )
    with pytest.raises(ScheduleError, match=r"rank 0 stuck at TIE0@s0; rank 1 stuck at TIE0@s1"):
        check_lists(schedule, lists, communicators=SHARED)
    check_lists(schedule, lists, communicators=SEPARATE)


def test_the_channels_are_per_direction_per_pair():
    lowered = lower(build_schedule("interleaved_1f1b", 4, 4, 2))
    pairs = ((0, 1), (0, 3), (1, 2), (2, 3))  # neighbours, and the wrap from the last rank to the first
    assert message_channels(lowered.actions) == [(d, low, high) for d in ("backward", "forward") for low, high in pairs]
