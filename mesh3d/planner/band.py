"""How sure the planner is: within its error band, a plan that leaves room beats a faster one that may not fit.

The planner's tokens/s stand within a hardware's error band of the published runs it was fitted on
(hardware.py, docs/plan.md), so two plans whose speeds differ by less than the band are not told
apart by the evidence. Its memory is surer (the published peaks stand 5 % above its predictions),
but a plan predicted within `constants.MEMORY_PREDICTION_BAND` of the memory limit may still run
out. So within a tier of plans as fast as each other to the band, the plans with room come first,
fastest first (their speeds are the best guess there is, and a few GiB more of an ample headroom
buys nothing), then the tight ones, the roomiest first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mesh3d.planner import constants as C

if TYPE_CHECKING:
    from mesh3d.planner.planned_layout import Plan


def check_band(tie_band: float | None) -> None:
    """Refuse a band that is not a fraction in [0, 1)."""
    if tie_band is not None and (
        isinstance(tie_band, bool) or not isinstance(tie_band, (int, float)) or not 0 <= tie_band < 1
    ):
        raise ValueError(f"plan: tie_band must be a fraction in [0, 1) (0 ranks by speed alone), got {tie_band!r}")


def is_tight(plan: Plan, limit: float) -> bool:
    """Whether the plan's predicted memory is within the prediction's own band of the limit."""
    return plan.memory_per_rank.total > limit * (1 - C.MEMORY_PREDICTION_BAND)


def rank_within_band(plans: Sequence[Plan], band: float, limit: float) -> list[Plan]:
    """The plans in tiers: a tier is the fastest plan left and every plan within `band` of its
    tokens/s. Within a tier the plans that are not tight (`is_tight` against `limit` bytes) come
    first, fastest first, then the tight ones, the least memory first. Each plan carries `band`."""
    remaining = sorted(plans, key=lambda p: -p.tokens_per_second_per_gpu)
    ranked: list[Plan] = []
    while remaining:
        floor = remaining[0].tokens_per_second_per_gpu * (1 - band)
        size = sum(1 for p in remaining if p.tokens_per_second_per_gpu >= floor)
        tier, remaining = remaining[:size], remaining[size:]
        ranked += [p for p in tier if not is_tight(p, limit)]
        ranked += sorted((p for p in tier if is_tight(p, limit)), key=lambda p: p.memory_per_rank.total)
    return [dataclasses.replace(p, error_band=band) for p in ranked]
