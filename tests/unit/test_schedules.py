"""The schedule IR, lowering, validation and the simulator (pure Python, one process).

Every built-in schedule is lowered and checked; bubble fractions equal their formulas to 1e-9
(GPipe and 1F1B (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1), ZB-H1 (p-1)/(3m+p-1) with f = i = w)
for p in {2, 4, 8}, v in {2, 4} and every m from p to 3p; peak live activations; the zero-bubble
schedules' gains hold at more than one I/W cost split.
"""

import pytest

from mesh3d.pipeline import SCHEDULES, Action, Kind, Schedule, ScheduleError, build_schedule, lower, simulate
from mesh3d.pipeline.schedule.communicators import SHARED
from mesh3d.pipeline.schedule.ir import stage_to_rank
from mesh3d.pipeline.schedule.lower import LoweredSchedule, check_lowered
from mesh3d.pipeline.schedule.timeline import timeline

PPS = (2, 4, 8)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", PPS)
def test_single_stage_bubble_is_exact(schedule, p):
    for m in range(p, 3 * p + 1):
        report = simulate(schedule, p, m)
        assert report.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9), (schedule, p, m)
        assert report.makespan == pytest.approx(3 * (m + p - 1))


@pytest.mark.parametrize("v", [2, 4])
@pytest.mark.parametrize("p", PPS)
def test_interleaved_bubble_is_exact_for_every_microbatch_count(p, v):
    for m in range(p, 3 * p + 1):  # multiples of p and every count in between
        report = simulate("interleaved_1f1b", p, m, v)
        assert report.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9), (p, v, m)


@pytest.mark.parametrize("p", PPS)
def test_peak_live_activations(p):
    for m in range(p, 3 * p + 1):
        assert simulate("gpipe", p, m).peak_activations == [m] * p
        one_f_one_b = simulate("1f1b", p, m).peak_activations
        assert max(one_f_one_b) <= p and one_f_one_b == [min(p - r, m) for r in range(p)]
        for v in (2, 4):
            peaks = simulate("interleaved_1f1b", p, m, v).peak_activations
            assert len(peaks) == p
            if m % p == 0:
                assert max(peaks) <= (v - 1) * p + 2 * (p - 1) + 1, (p, v, m, peaks)


def test_costs_change_the_makespan_not_the_order():
    even = simulate("1f1b", 4, 8, f_cost=1.0, b_cost=1.0)
    assert even.bubble_fraction == pytest.approx(3 / 11)
    slow_links = simulate("1f1b", 4, 8, comm_cost=0.5)
    assert slow_links.makespan > simulate("1f1b", 4, 8).makespan


def test_every_compute_action_once_on_its_rank():
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)):
        schedule = build_schedule(name, 4, 6, v)
        seen = [(a.stage, a.kind, a.microbatch) for acts in schedule.actions for a in acts]
        assert len(seen) == len(set(seen)) == 2 * 4 * v * 6
        for rank, acts in enumerate(schedule.actions):
            assert all(schedule.stage_rank(a.stage) == rank for a in acts)


def test_interleaved_matches_megatron_order_when_m_is_a_multiple():
    schedule = build_schedule("interleaved_1f1b", 2, 4, 2)
    rank0 = [str(a) for a in schedule.actions[0]]
    # warm-up (v-1)*p + 2*(p-1-r) = 4 forwards: chunk 0 on microbatches 0,1 then chunk 1 on 0,1
    assert rank0[:4] == ["F0@s0", "F1@s0", "F0@s2", "F1@s2"]
    assert rank0[4:6] == ["F2@s0", "B0@s2"]


def test_lowering_pairs_every_send_with_a_receive():
    lowered = lower(build_schedule("interleaved_1f1b", 2, 3, 2))
    sends = {
        (a.stage, a.kind, a.microbatch)
        for acts in lowered.actions
        for a in acts
        if a.kind in (Kind.SEND_F, Kind.SEND_B)
    }
    recvs = {
        (a.stage, a.kind, a.microbatch)
        for acts in lowered.actions
        for a in acts
        if a.kind in (Kind.RECV_F, Kind.RECV_B)
    }
    as_sent = {
        (s + 1 if k == Kind.SEND_F else s - 1, Kind.RECV_F if k == Kind.SEND_F else Kind.RECV_B, j) for s, k, j in sends
    }
    assert as_sent == recvs
    assert len(sends) == 2 * 3 * 3  # 3 boundaries, forward and backward, 3 microbatches
    for rank, acts in enumerate(lowered.actions):
        for i, action in enumerate(acts):
            if action.kind in (Kind.RECV_F, Kind.RECV_B):
                use = Action(action.stage, Kind.F if action.kind == Kind.RECV_F else Kind.B, action.microbatch)
                assert use in acts[i + 1 :], f"rank {rank}: {action} posted after its use"


def test_one_rank_pipeline_needs_no_communication():
    lowered = lower(build_schedule("interleaved_1f1b", 1, 2, 3))
    assert all(a.kind in (Kind.F, Kind.B) for a in lowered.actions[0])


def _hand_made(actions, pp=2, m=1):
    return Schedule("hand-made", pp, m, 1, tuple(tuple(a) for a in actions))


def test_schedule_that_cannot_finish_is_rejected():
    F, B = Kind.F, Kind.B
    # rank 0 wants its backward before the forward that rank 1 needs first
    backwards_first = _hand_made([[Action(0, B, 0), Action(0, F, 0)], [Action(1, F, 0), Action(1, B, 0)]])
    with pytest.raises(ScheduleError, match="cannot finish"):
        timeline(backwards_first)
    missing = _hand_made([[Action(0, F, 0)], [Action(1, F, 0), Action(1, B, 0)]])
    with pytest.raises(ScheduleError, match="never run"):
        timeline(missing)
    wrong_rank = _hand_made([[Action(0, F, 0), Action(1, F, 0)], [Action(1, B, 0), Action(0, B, 0)]])
    with pytest.raises(ScheduleError, match="belongs on rank"):
        timeline(wrong_rank)


def test_lowered_lists_with_crossed_messages_are_rejected():
    F, B = Kind.F, Kind.B
    # Both ranks wait for the other's message before posting their own: a cycle.
    crossed = LoweredSchedule(
        _hand_made([[Action(0, F, 0), Action(0, B, 0)], [Action(1, F, 0), Action(1, B, 0)]]),
        (
            (Action(1, Kind.RECV_B, 0, 1), Action(0, B, 0), Action(0, F, 0), Action(0, Kind.SEND_F, 0, 1)),
            (Action(1, Kind.RECV_F, 0, 0), Action(1, F, 0), Action(1, B, 0), Action(1, Kind.SEND_B, 0, 0)),
        ),
    )
    with pytest.raises(ScheduleError):
        check_lowered(crossed)
    # Two messages between one pair listed in opposite orders: NCCL would pair them wrongly.
    good = lower(build_schedule("1f1b", 2, 2))
    rank1 = list(good.actions[1])
    recvs = [i for i, a in enumerate(rank1) if a.kind == Kind.RECV_F]
    rank1[recvs[0]], rank1[recvs[1]] = rank1[recvs[1]], rank1[recvs[0]]
    with pytest.raises(ScheduleError, match="different orders"):
        check_lowered(LoweredSchedule(good.schedule, (good.actions[0], tuple(rank1))))


def test_forward_only_schedule_keeps_forward_order():
    schedule = build_schedule("1f1b", 4, 4)
    forward = schedule.forward_only()
    for full, only in zip(schedule.actions, forward.actions):
        assert list(only) == [a for a in full if a.kind == Kind.F]
    assert simulate("1f1b", 4, 4).peak_activations == [4, 3, 2, 1]
    lower(forward)


def test_placements():
    assert [stage_to_rank(s, 4, 2) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [stage_to_rank(s, 4, 2, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="exactly 2 stages"):
        stage_to_rank(0, 4, 3, "v")


@pytest.mark.parametrize(
    "args, match",
    [
        (
            ("dualpipe", 2, 4),
            r"unknown pipeline schedule 'dualpipe'; choose one of \['1f1b', 'dualpipev', 'gpipe', "
            r"'interleaved_1f1b', 'pipedream', 'pipedream_2bw', 'zbv', 'zero_bubble'\]",
        ),
        (("dualpipev", 4, 7, 2), r"needs microbatches >= 2\*pp, got microbatches=7 with pp=4; use at least 8"),
        (("zbv", 4, 3, 2), "needs microbatches >= pp, got microbatches=3 with pp=4"),
        (("zbv", 2, 4, 3), "places exactly 2 stages per rank"),
        (("zero_bubble", 4, 2, 2), "needs microbatches >= pp"),
        (("1f1b", 4, 3), "needs microbatches >= pp, got microbatches=3 with pp=4"),
        (("interleaved_1f1b", 4, 2, 2), "needs microbatches >= pp"),
        (("gpipe", 2, 4, 2), "runs one stage per rank, but virtual_stages=2"),
        (("1f1b", 2, 0), "microbatches must be a positive integer"),
    ],
)
def test_config_errors(args, match):
    with pytest.raises(ValueError, match=match):
        simulate(*args)


def test_gpipe_accepts_fewer_microbatches_than_stages():
    assert simulate("gpipe", 4, 2).peak_activations == [2] * 4


def test_every_builtin_schedule_passes_the_single_stream_check():
    """Every schedule that drains finishes even with all of a rank's messages on one communicator
    (SHARED: one in-order queue per rank), the strictest order; so under any finer assignment too."""
    count = 0
    for name, virtual in (
        ("gpipe", (1,)),
        ("1f1b", (1,)),
        ("interleaved_1f1b", (1, 2, 3)),
        ("zero_bubble", (1, 2)),
        ("zbv", (2,)),
        ("dualpipev", (2,)),
    ):
        for p in range(1, 9):
            for m in range(SCHEDULES[name].min_microbatches(p), 3 * p + 2):
                for v in virtual:
                    lower(build_schedule(name, p, m, v), communicators=SHARED)
                    count += 1
    assert count > 400


# Zero-bubble schedules, with f = 1, b = 2 of which w = 1 (so I = W = F in cost).
ZB_COSTS = {"f_cost": 1.0, "b_cost": 2.0, "w_cost": 1.0}


@pytest.mark.parametrize("p", PPS)
def test_zero_bubble_h1_bubble_is_a_third_of_1f1b(p):
    for m in range(p, 3 * p + 1):
        report = simulate("zero_bubble", p, m, 1, **ZB_COSTS)
        assert report.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-9), m
        assert max(report.peak_activations) <= p, (m, report.peak_activations)
        one_f_one_b = simulate("1f1b", p, m, 1, **ZB_COSTS)
        assert report.makespan - 3 * m == pytest.approx((one_f_one_b.makespan - 3 * m) / 3), m


@pytest.mark.parametrize("p", PPS)
def test_interleaved_zero_bubble_beats_interleaved_1f1b_and_zb_h1(p):
    for m in range(p, 3 * p + 1):
        bubble = simulate("zero_bubble", p, m, 2, **ZB_COSTS).bubble_fraction
        assert bubble < simulate("interleaved_1f1b", p, m, 2, **ZB_COSTS).bubble_fraction, m
        assert bubble < simulate("zero_bubble", p, m, 1, **ZB_COSTS).bubble_fraction, m


@pytest.mark.parametrize("p", PPS)
def test_interleaved_zero_bubble_keeps_its_gain_when_input_gradients_cost_more_than_weight_gradients(p):
    """With I = 1.3, W = 0.7 (the measured split of a LLaMA block) it still beats both. A greedy
    order (ready I first, then F, then W) wins at w = 1 but lost this: at p=8 it fell behind
    interleaved 1F1B (m=16: 23.1 % against 17.9 %)."""
    costs = dict(f_cost=1.0, b_cost=2.0, w_cost=0.7)
    for m in range(p, 3 * p + 1):
        bubble = simulate("zero_bubble", p, m, 2, **costs).bubble_fraction
        assert bubble < simulate("interleaved_1f1b", p, m, 2, **costs).bubble_fraction, m
        assert bubble < simulate("zero_bubble", p, m, 1, **costs).bubble_fraction, m


@pytest.mark.parametrize("p", PPS)
def test_zbv_beats_zb_h1_within_2p_half_stage_activations(p):
    for m in range(p, 3 * p + 1):
        report = simulate("zbv", p, m, 2, **ZB_COSTS)  # lowers too: it can finish for every m >= p
        assert report.schedule.placement == "v"
        if m >= 2 * p:
            assert report.bubble_fraction < simulate("zero_bubble", p, m, 1, **ZB_COSTS).bubble_fraction, m
            assert max(report.peak_activations) <= 2 * p, (m, report.peak_activations)


@pytest.mark.parametrize("p", PPS)
def test_zbv_keeps_its_gain_when_input_gradients_cost_more_than_weight_gradients(p):
    """On real blocks I costs about 1.3 and W 0.7 (bench/peer_speed.py's stage: 37 ms and 22 ms).
    ZBV's pattern runs each I next to its W, so its bubble stays below half of interleaved 1F1B's;
    a greedy order played with F = I = W lost that (p=4, m=8: 24 % where this gives 7.5 %)."""
    for m in range(2 * p, 3 * p + 1):
        zbv = simulate("zbv", p, m, 2, b_cost=2.0, w_cost=0.7).bubble_fraction
        assert zbv < 0.5 * simulate("interleaved_1f1b", p, m, 2, b_cost=2.0, w_cost=0.7).bubble_fraction, m


def test_split_backward_costs():
    """b_cost stays the whole backward: I costs b - w, W costs w; w = 0 keeps the other schedules' figures."""
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        assert simulate(name, 4, 8, v, w_cost=0.0).makespan == simulate(name, 4, 8, v).makespan
    report = simulate("zero_bubble", 4, 8, 1, b_cost=3.0, w_cost=1.0)
    durations = {a.kind: e.end - e.start for e in report.events for a in [e.action]}
    assert durations == {Kind.F: 1.0, Kind.I: 2.0, Kind.W: 1.0}
    assert simulate("zero_bubble", 2, 4).makespan > 0  # w = 0: W takes no time, still a valid schedule
    with pytest.raises(ValueError, match="0 <= w_cost < b_cost"):
        simulate("zero_bubble", 2, 4, w_cost=2.0)


def test_zero_bubble_lists_f_i_w_once_each_and_w_after_its_i():
    schedule = build_schedule("zbv", 4, 8, 2)
    for rank, actions in enumerate(schedule.actions):
        assert {a.kind for a in actions} == {Kind.F, Kind.I, Kind.W}
        assert len(actions) == 3 * 2 * 8
        assert {a.stage for a in actions} == {rank, 2 * 4 - 1 - rank}
        position = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(actions)}
        for (kind, stage, j), i in position.items():
            if kind == Kind.W:
                assert position[(Kind.I, stage, j)] < i
