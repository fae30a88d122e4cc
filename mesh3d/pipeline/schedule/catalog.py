"""The named schedules `parallelize` and `simulate` accept, their defaults, and the checks on their sizes.

This is the one list of schedules: `parallelize`'s docstring, docs/pipeline.md and docs/training.md
name the same ones with the rules below (tests/unit/test_documented_lists.py holds them to it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mesh3d.pipeline.schedule.dualpipe_v import dualpipe_v
from mesh3d.pipeline.schedule.generators import gpipe, interleaved_one_f_one_b, one_f_one_b
from mesh3d.pipeline.schedule.ir import Schedule
from mesh3d.pipeline.schedule.never_drain import never_drain
from mesh3d.pipeline.schedule.zero_bubble import zero_bubble, zero_bubble_v

DEFAULT_MICROBATCHES = "pp"  # how the docs say it: microbatches=None means one per pp rank


@dataclass(frozen=True)
class ScheduleSpec:
    generator: Callable[[int, int, int], Schedule]
    multi_stage: bool  # may hold more than one stage per rank (virtual_stages > 1)
    # The fewest microbatches per pp rank it runs: 0 any count; 1 at least pp (the 1F1B family
    # deadlocks or idles with fewer); 2 at least 2*pp (dualpipev: as many as its stages, as torch's
    # ScheduleDualPipeV requires; its steady state has a negative length with fewer).
    min_microbatches_per_rank: int
    default_virtual_stages: int | None  # None: 2 when pp > 1 and the model has at least 2*pp layers, else 1
    fixed_virtual_stages: int | None = None  # the only virtual_stages it takes (zbv, dualpipev: a V needs exactly 2)
    never_drains: bool = False  # calls overlap; weights update inside the pipeline (never_drain.py)
    # Each microbatch is an update of its own ("pipedream"), so its loss is scaled as a whole
    # batch's would be (step/global_loss.py).
    loss_per_microbatch: bool = False

    @property
    def virtual_stages_rule(self) -> str:
        """The default virtual_stages, as the docs state it."""
        if self.default_virtual_stages is None:
            return "2 when pp > 1 and the model has at least 2*pp layers, else 1"
        if self.fixed_virtual_stages is not None:
            return f"{self.fixed_virtual_stages} (the only value it takes)"
        return str(self.default_virtual_stages)

    @property
    def microbatches_rule(self) -> str:
        """Which microbatch counts it runs, as the docs state it."""
        per_rank = self.min_microbatches_per_rank
        return "any count" if per_rank == 0 else "at least pp" if per_rank == 1 else f"at least {per_rank}*pp"

    def min_microbatches(self, pp: int) -> int:
        """The fewest microbatches it runs at this pp (microbatches_rule, as a number)."""
        return max(1, self.min_microbatches_per_rank * pp)


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(gpipe, multi_stage=False, min_microbatches_per_rank=0, default_virtual_stages=1),
    "1f1b": ScheduleSpec(one_f_one_b, multi_stage=False, min_microbatches_per_rank=1, default_virtual_stages=1),
    "interleaved_1f1b": ScheduleSpec(
        interleaved_one_f_one_b, multi_stage=True, min_microbatches_per_rank=1, default_virtual_stages=None
    ),
    "zero_bubble": ScheduleSpec(zero_bubble, multi_stage=True, min_microbatches_per_rank=1, default_virtual_stages=1),
    "zbv": ScheduleSpec(
        zero_bubble_v, multi_stage=True, min_microbatches_per_rank=1, default_virtual_stages=2, fixed_virtual_stages=2
    ),
    "dualpipev": ScheduleSpec(
        dualpipe_v, multi_stage=True, min_microbatches_per_rank=2, default_virtual_stages=2, fixed_virtual_stages=2
    ),
    "pipedream": ScheduleSpec(
        never_drain("pipedream"),
        multi_stage=False,
        min_microbatches_per_rank=1,
        default_virtual_stages=1,
        never_drains=True,
        loss_per_microbatch=True,
    ),
    "pipedream_2bw": ScheduleSpec(
        never_drain("pipedream_2bw"),
        multi_stage=False,
        min_microbatches_per_rank=1,
        default_virtual_stages=1,
        never_drains=True,
    ),
}


def default_microbatches(pp: int) -> int:
    """microbatches when none is given: one per pp rank (DEFAULT_MICROBATCHES)."""
    return pp


def default_virtual_stages(schedule: str, pp: int, n_layers: int) -> int:
    """virtual_stages when none is given (ScheduleSpec.virtual_stages_rule); 1 for an unknown
    schedule, which check_schedule_config then names."""
    spec = SCHEDULES.get(schedule)
    if spec is None:
        return 1
    if spec.default_virtual_stages is not None:
        return spec.default_virtual_stages
    # At pp = 1 two stages on the one rank would be a pipeline of one rank: its bubble, none of its gain.
    return 2 if pp > 1 and n_layers >= 2 * pp else 1


def check_schedule_config(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> None:
    """Raise ValueError with what to change if `schedule` cannot run with these sizes.

    Pure arithmetic, so every rank raises the same error before any collective.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    spec = SCHEDULES[schedule]
    for name, value in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if virtual_stages > 1 and not spec.multi_stage:
        multi = sorted(n for n, s in SCHEDULES.items() if s.multi_stage)
        raise ValueError(
            f"schedule {schedule!r} runs one stage per rank, but virtual_stages={virtual_stages}; "
            f"use virtual_stages=1 or a multi-stage schedule ({', '.join(multi)})"
        )
    if spec.fixed_virtual_stages is not None and virtual_stages != spec.fixed_virtual_stages:
        raise ValueError(
            f"schedule {schedule!r} places exactly {spec.fixed_virtual_stages} stages per rank (rank r holds stages "
            f"r and 2*pp-1-r), got virtual_stages={virtual_stages}; leave virtual_stages out or pass "
            f"{spec.fixed_virtual_stages}"
        )
    least = spec.min_microbatches(pp)
    if microbatches < least:
        rule = spec.microbatches_rule.replace("at least ", "microbatches >= ")
        raise ValueError(
            f"schedule {schedule!r} needs {rule}, got microbatches={microbatches} with pp={pp}; "
            f"use at least {least} microbatches (or {_takes_fewer_microbatches(schedule)})"
        )


def _takes_fewer_microbatches(schedule: str) -> str:
    """A schedule like `schedule` (the same fixed virtual_stages) that runs with fewer microbatches
    per rank, as an error's suggestion: zbv for dualpipev, gpipe for the others."""
    spec = SCHEDULES[schedule]
    for name, other in SCHEDULES.items():
        same_v = spec.fixed_virtual_stages is not None and other.fixed_virtual_stages == spec.fixed_virtual_stages
        if same_v and other.min_microbatches_per_rank < spec.min_microbatches_per_rank:
            return f"schedule={name!r}, which needs {other.microbatches_rule.replace('at least ', 'microbatches >= ')}"
    return "schedule='gpipe'"


def build_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The compute-only schedule IR for one of SCHEDULES, after checking the sizes."""
    check_schedule_config(schedule, pp, microbatches, virtual_stages)
    return SCHEDULES[schedule].generator(pp, microbatches, virtual_stages)
