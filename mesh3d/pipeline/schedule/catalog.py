"""The named schedules `parallelize` and `simulate` accept, and the checks on their sizes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mesh3d.pipeline.schedule.generators import gpipe, interleaved_one_f_one_b, one_f_one_b
from mesh3d.pipeline.schedule.ir import Schedule
from mesh3d.pipeline.schedule.zero_bubble import zero_bubble, zero_bubble_v


@dataclass(frozen=True)
class ScheduleSpec:
    generator: Callable[[int, int, int], Schedule]
    multi_stage: bool  # may hold more than one stage per rank (virtual_stages > 1)
    needs_pp_microbatches: bool  # deadlocks or idles with fewer microbatches than pp
    default_virtual_stages: int | None = None  # None: 2 for a multi-stage schedule when the model is deep enough
    fixed_virtual_stages: int | None = None  # the only virtual_stages it takes (zbv: its V needs exactly 2)


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(gpipe, multi_stage=False, needs_pp_microbatches=False),
    "1f1b": ScheduleSpec(one_f_one_b, multi_stage=False, needs_pp_microbatches=True),
    "interleaved_1f1b": ScheduleSpec(interleaved_one_f_one_b, multi_stage=True, needs_pp_microbatches=True),
    "zero_bubble": ScheduleSpec(zero_bubble, multi_stage=True, needs_pp_microbatches=True, default_virtual_stages=1),
    "zbv": ScheduleSpec(zero_bubble_v, multi_stage=True, needs_pp_microbatches=True, default_virtual_stages=2,
                        fixed_virtual_stages=2),
}


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
    if spec.needs_pp_microbatches and microbatches < pp:
        raise ValueError(
            f"schedule {schedule!r} needs microbatches >= pp, got microbatches={microbatches} with pp={pp}; "
            f"use at least {pp} microbatches (or schedule='gpipe')"
        )


def build_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The compute-only schedule IR for one of SCHEDULES, after checking the sizes."""
    check_schedule_config(schedule, pp, microbatches, virtual_stages)
    return SCHEDULES[schedule].generator(pp, microbatches, virtual_stages)
