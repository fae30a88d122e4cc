"""How far the planner stands from a published run its fit did not see: leave-one-out.

A preset's achievable fraction (hardware.py) is fitted on published runs of its GPU: the fraction
at which its largest over- and under-prediction of them balance, the smallest largest error (each
run's predicted tokens/s grow with the fraction, so the balance is one bisection). Its errors on
those runs are in-sample: the fit saw them, and a band drawn from them flatters it. Leave-one-out
refits the fraction without each run in turn and predicts that run at the refit; a run the preset
was never fitted on is held out as it stands. The band a preset states comes from these held-out
errors (tests/unit/test_plan_published.py holds hardware.py's figures to them, docs/plan.md shows
both).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

# (run, achievable fraction) -> the run's error there: predicted / published tokens/s - 1.
ErrorAt = Callable[[str, float], float]

# Where the fit looks: no GPU's step reaches under 5 % of its peak, none more than all of it.
FRACTION_RANGE = (0.05, 1.0)


@dataclass(frozen=True)
class HeldOutBand:
    """A preset's held-out errors (each run predicted by the preset refitted without it), and the
    in-sample error (its fit's largest, on the runs it was fitted on) beside them."""

    low: float  # the most negative held-out error (an under-prediction), <= 0 unless none is
    high: float  # the most positive
    runs: int  # the published runs held out in turn
    in_sample: float  # the largest |error| of the fitted runs at the preset's fraction

    @property
    def largest(self) -> float:
        """The largest held-out |error|: what a symmetric band must cover."""
        return max(-self.low, self.high)

    def text(self) -> str:
        """One line: "-13.5 %/+12.1 % (held out, leave-one-out over 7 published runs; in-sample ±9.1 %)"."""
        return (
            f"{percent(self.low)}/{percent(self.high)} (held out, leave-one-out over {self.runs} published "
            f"runs; in-sample ±{percent(self.in_sample, sign=False)})"
        )


def percent(error: float, sign: bool = True) -> str:
    """`error` as docs/plan.md writes it: "+3.2 %"."""
    return f"{error:{'+' if sign else ''}.1%}".replace("%", " %")


def balanced_fraction(
    error_at: ErrorAt, runs: Sequence[str], tolerance: float = 1e-5, bounds: tuple[float, float] = FRACTION_RANGE
) -> float:
    """The achievable fraction at which the largest over- and under-prediction of `runs` balance
    (the largest |error| is smallest there): their sum within `tolerance` of 0. Raises ValueError
    without runs, or when the balance lies outside `bounds`."""
    if not runs:
        raise ValueError("balanced_fraction: no runs to fit on")

    def imbalance(fraction: float) -> float:  # grows with the fraction: every error does
        errors = [error_at(run, fraction) for run in runs]
        return max(errors) + min(errors)

    (low, high), steps = bounds, 0
    g_low, g_high = imbalance(low), imbalance(high)
    if g_low > 0 or g_high < 0:
        raise ValueError(f"balanced_fraction: the balance of {list(runs)} lies outside fractions {bounds}")
    # False position with the Illinois step (a kept end's value halved): a handful of evaluations,
    # where bisection takes seventeen, and each is a plan; the bracket still always holds the root.
    side = 0
    while steps < 100:
        steps += 1
        middle = high - g_high * (high - low) / (g_high - g_low) if g_high != g_low else (low + high) / 2
        g = imbalance(middle)
        if abs(g) <= tolerance:
            return middle
        if g > 0:
            high, g_high = middle, g
            g_low = g_low / 2 if side == -1 else g_low
            side = -1
        else:
            low, g_low = middle, g
            g_high = g_high / 2 if side == 1 else g_high
            side = 1
    raise ValueError(f"balanced_fraction: no balance of {list(runs)} within {tolerance} in {steps} steps")


def leave_one_out(
    error_at: ErrorAt, fitted: Sequence[str], unfitted: Sequence[str] = (), fraction: float | None = None
) -> dict[str, float]:
    """Each run's held-out error: a fitted run's at the fraction balanced on the other fitted runs,
    an unfitted run's at `fraction` (the preset's own: refitting without a run the fit never saw
    changes nothing; None: `fitted`'s balance). Needs two fitted runs at least: one left out, one
    to fit on."""
    if len(fitted) < 2:
        raise ValueError(f"leave_one_out: needs two fitted runs or more, got {list(fitted)}")
    held = {run: error_at(run, balanced_fraction(error_at, [r for r in fitted if r != run])) for run in fitted}
    if unfitted:
        whole = balanced_fraction(error_at, fitted) if fraction is None else fraction
        held.update({run: error_at(run, whole) for run in unfitted})
    return held


def held_out_band(held_out: Mapping[str, float], in_sample: Mapping[str, float]) -> HeldOutBand:
    """The band of `held_out`'s errors, with the largest |error| of `in_sample` (the fitted runs at
    the preset's own fraction), each rounded outwards to a tenth of a percent (a stated band covers
    what it was drawn from)."""
    return HeldOutBand(
        low=_outwards(min(held_out.values())),
        high=_outwards(max(held_out.values())),
        runs=len(held_out),
        in_sample=_outwards(max(abs(e) for e in in_sample.values())),
    )


def _outwards(error: float) -> float:
    """`error` rounded away from 0 to 0.1 %."""
    return math.copysign(math.ceil(abs(error) * 1000 - 1e-9) / 1000, error)


def covering_band(band: HeldOutBand) -> float:
    """The symmetric band (a whole percent) that covers every held-out error: a preset's `error_band`."""
    return math.ceil(band.largest * 100 - 1e-9) / 100
