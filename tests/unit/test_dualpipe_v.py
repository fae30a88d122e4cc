"""schedule="dualpipev": torch's order, every action once, lowering, and DeepSeek's bubble and memory figures.

The references are independent of mesh3d's generator: torch 2.13's own ScheduleDualPipeV lists
(its per-rank builder, called without process groups), and DeepSeek's DualPipe README table
(DualPipeV: bubble (PP/2-1)(F&B+B-3W), PP+1 stage activations per device, PP = stages = 2*pp).
"""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _ComputationType

from mesh3d.pipeline import Action, Kind, build_schedule, lower
from mesh3d.pipeline.schedule.dualpipe_v import dualpipe_v_chunks
from mesh3d.pipeline.schedule.simulate import SimulationReport, simulate_schedule
from mesh3d.pipeline.schedule.timeline import dependencies

SIZES = [(pp, m) for pp in range(1, 9) for m in range(2 * pp, 4 * pp + 1)]  # every m torch takes up to 4*pp
SOME_SIZES = [(pp, m) for pp in range(1, 9) for m in sorted({2 * pp, 3 * pp + 1, 4 * pp})]


def simulate(name: str, pp: int, m: int, **costs) -> SimulationReport:
    """The timeline of a V (2 stages per rank) schedule; lowering is checked once, below, not per cost."""
    return simulate_schedule(build_schedule(name, pp, m, 2), **costs)


def torch_chunks(pp: int, m: int, rank: int) -> tuple[tuple[Action, ...], ...]:
    """torch's list for `rank`, each entry as mesh3d actions: a whole backward as I then W, an
    overlapped forward and backward as the forward then the backward."""
    owner = SimpleNamespace(pp_group_size=pp, _n_microbatches=m)  # all its builder reads
    ops = ScheduleDualPipeV._calculate_single_rank_operations(owner, rank)

    def as_mesh3d(op) -> tuple[Action, ...]:
        if op.computation_type == _ComputationType.OVERLAP_F_B:
            return tuple(a for sub in op.sub_actions for a in as_mesh3d(sub))
        stage, j = op.stage_index, op.microbatch_index
        if op.computation_type == _ComputationType.FULL_BACKWARD:
            return Action(stage, Kind.I, j), Action(stage, Kind.W, j)
        return (Action(stage, Kind(op.computation_type.value), j),)

    return tuple(as_mesh3d(op) for op in ops)


def test_the_order_is_torchs():
    for pp, m in SIZES:
        chunks = dualpipe_v_chunks(pp, m)
        for rank in range(pp):
            assert chunks[rank] == torch_chunks(pp, m, rank), (pp, m, rank)


def test_every_stage_and_microbatch_runs_f_i_w_once_on_its_rank():
    for pp, m in SIZES:
        schedule = build_schedule("dualpipev", pp, m, 2)
        assert schedule.placement == "v" and schedule.virtual_stages == 2
        seen = [(a.stage, a.kind, a.microbatch) for acts in schedule.actions for a in acts]
        assert sorted(seen) == sorted(
            (s, k, j) for s in range(2 * pp) for k in (Kind.F, Kind.I, Kind.W) for j in range(m)
        ), (pp, m)
        for rank, acts in enumerate(schedule.actions):
            assert {a.stage for a in acts} == {rank, 2 * pp - 1 - rank}
            position = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(acts)}
            assert all(position[(Kind.I, s, j)] < i for (k, s, j), i in position.items() if k == Kind.W)


def test_lowering_passes_for_every_allowed_size():
    for pp, m in SIZES:
        lower(build_schedule("dualpipev", pp, m, 2))  # check_lowered: every rank reaches its end


@pytest.mark.parametrize(
    "args, match",
    [
        (
            ("dualpipev", 4, 7, 2),
            r"needs microbatches >= 2\*pp, got microbatches=7 with pp=4; use at least 8 "
            r"microbatches \(or schedule='zbv', which needs microbatches >= pp\)",
        ),
        (("dualpipev", 1, 1, 2), "use at least 2 microbatches"),
        (("dualpipev", 2, 4, 1), "places exactly 2 stages per rank"),
    ],
)
def test_sizes_it_cannot_run_say_what_to_change(args, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(*args)


def overlapped_idle(pp: int, m: int, f: float, b: float, w: float) -> list[float]:
    """Idle time per rank when each chunk runs as one step, as DualPipe runs it: an overlapped
    forward and backward starts once both the forward's input and the backward's gradient are
    there, and takes F&B = f + b. Written here, apart from timeline(), as the README's model."""
    chunks = dualpipe_v_chunks(pp, m)
    cost = {Kind.F: f, Kind.I: b - w, Kind.W: w}
    finished: dict[Action, float] = {}
    free_at, busy, position = [0.0] * pp, [0.0] * pp, [0] * pp
    moved = True
    while moved:
        moved = False
        for rank in range(pp):
            while position[rank] < len(chunks[rank]):
                chunk = chunks[rank][position[rank]]
                needs = [d for a in chunk for d in dependencies(a, 2 * pp) if d not in chunk]
                if any(d not in finished for d in needs):
                    break
                start = max([free_at[rank], *(finished[d] for d in needs)])
                took = sum(cost[a.kind] for a in chunk)
                finished.update({a: start + took for a in chunk})
                free_at[rank], busy[rank], position[rank] = start + took, busy[rank] + took, position[rank] + 1
                moved = True
    assert position == [len(c) for c in chunks], "the overlapped play did not finish"
    return [max(free_at) - b for b in busy]


def readme_bubble(pp: int, f: float, b: float, w: float) -> float:
    """DeepSeek's DualPipe README, DualPipeV row: (PP/2 - 1)(F&B + B - 3W), PP the stages (2*pp)."""
    stages = 2 * pp
    return (stages / 2 - 1) * ((f + b) + b - 3 * w)


def test_the_readme_bubble_holds_when_chunks_overlap_as_in_dualpipe():
    """F = I = W (f=1, b=2, w=1: the chunks DeepSeek draws): every rank idles exactly the README's
    2*(pp-1), whatever m."""
    for pp, m in SIZES:
        assert overlapped_idle(pp, m, 1.0, 2.0, 1.0) == pytest.approx([readme_bubble(pp, 1.0, 2.0, 1.0)] * pp), (pp, m)


def test_run_one_after_the_other_the_bubble_is_half_the_readmes():
    """mesh3d runs an overlapped chunk's forward, then its backward: the forward no longer waits
    for the backward's gradient. With F = I = W the idle time per rank is (pp-1)*F, half the
    README's; with I costing more than W (real blocks) it stays within the overlapped play's."""
    for pp, m in SIZES:
        report = simulate("dualpipev", pp, m, f_cost=1.0, b_cost=2.0, w_cost=1.0)
        idle = [report.makespan - busy for busy in report.busy]
        assert idle == pytest.approx([readme_bubble(pp, 1.0, 2.0, 1.0) / 2] * pp), (pp, m)
        assert idle == pytest.approx([pp - 1.0] * pp)
        for w in (0.5, 0.7):
            report = simulate("dualpipev", pp, m, f_cost=1.0, b_cost=2.0, w_cost=w)
            sequential = max(report.makespan - busy for busy in report.busy)
            assert sequential <= max(overlapped_idle(pp, m, 1.0, 2.0, w)) + 1e-9, (pp, m, w)


def test_peak_activations_are_the_readmes_pp_plus_one():
    """The README's DualPipeV memory: PP + 1 = 2*pp + 1 stage activations per device (zbv: 2*pp)."""
    for pp, m in SIZES:
        assert simulate("dualpipev", pp, m, w_cost=1.0).peak_activations == [2 * pp + 1] * pp, (pp, m)


def test_against_zbv_and_interleaved_1f1b():
    """Run on one stream, DualPipeV's overlap buys nothing: with F = I = W it idles as long as zbv
    (pp-1 per rank); with I = 1.3, W = 0.7 (a LLaMA block's measured split, see test_schedules.py)
    it idles longer than zbv, which runs each I next to its W, and still less than interleaved 1F1B."""
    for pp, m in SOME_SIZES:
        even = simulate("dualpipev", pp, m, w_cost=1.0).bubble_fraction
        assert even == pytest.approx(simulate("zbv", pp, m, w_cost=1.0).bubble_fraction, abs=1e-9), (pp, m)
        if pp == 1:
            continue  # one rank: no bubble in any of them
        costs = dict(f_cost=1.0, b_cost=2.0, w_cost=0.7)
        real = simulate("dualpipev", pp, m, **costs).bubble_fraction
        assert simulate("zbv", pp, m, **costs).bubble_fraction < real, (pp, m)
        assert real < simulate("interleaved_1f1b", pp, m, **costs).bubble_fraction, (pp, m)
