"""The dry run's verdict on the planner (mesh3d/planner/verify_plan.py, fake_cluster.RankReport):
a byte count a rank holds above the planner's, or below it on a stage's first rank, and a group
kind whose bytes a step differ, are each named with both figures; a later dp rank holding less
(FSDP's padding) is not a difference; a layout without figures is no verdict."""

from mesh3d.planner.fake_cluster import RankReport
from mesh3d.planner.verify_plan import verdict

PREDICTED = {"parameters": 100, "gradients": 100, "optimizer": 200, "sent on dp": 300, "sent on tp": 50}


def _report(rank=0, dp=0, held=100, dp_sent=300, **changes) -> RankReport:
    fields = dict(
        rank=rank,
        world_size=16,
        coordinate={"pp": 0, "dp": dp, "tp": 0},
        setup_seconds=1.0,
        world_creations=0,
        member_creations=5,
        communicators=5,
        parameter_bytes=held,
        gradient_bytes=held,
        optimizer_bytes=2 * held,
        traffic={},
        sent_per_step={"dp": dp_sent, "tp": 50, "default_pg": 63},
        predicted=dict(PREDICTED),
    )
    return RankReport(**{**fields, **changes})


def test_agreeing_ranks_pass_and_a_later_dp_rank_may_hold_less():
    agreed, line = verdict([_report(), _report(rank=3, dp=3, held=96)])
    assert agreed, line
    assert line.startswith("verify: the planner's parameter, gradient and optimizer bytes and the bytes each group")
    assert "FSDP pads" in line


def test_each_difference_is_named_with_both_figures():
    agreed, line = verdict([_report(held=96), _report(rank=3, dp=3, held=104, dp_sent=280)])
    assert not agreed
    assert "rank 0 parameters: holds 96 bytes, the planner says 100" in line
    assert "rank 3 optimizer: holds 208 bytes, the planner says 200" in line
    assert "rank 3 sent on dp: 280 bytes a step, the planner says 300" in line
    assert "default_pg" not in line  # the agreements' bytes are not the planner's


def test_no_figures_is_no_verdict_and_unpredicted_traffic_is_said():
    agreed, line = verdict([_report(predicted={}, predicted_why_not="ValueError: no plan fits")])
    assert not agreed and "no figures" in line and "no plan fits" in line
    held_only = {k: v for k, v in PREDICTED.items() if not k.startswith("sent")}
    why = "under expert parallelism its all-to-alls (ep) ... are not predicted"
    agreed, line = verdict([_report(predicted=held_only, traffic_why_not=why)])
    assert agreed and line.endswith(f"(not checked: {why})")
    some = {**held_only, "sent on dp": PREDICTED["sent on dp"]}  # the kinds it does predict, named
    agreed, line = verdict([_report(predicted=some, traffic_why_not=why)])
    assert agreed and "optimizer bytes and the bytes sent on dp equal" in line, line
