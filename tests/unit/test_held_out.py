"""mesh3d/planner/held_out.py on runs of a known step: seconds = compute / fraction + the rest.

The published runs themselves (tests/unit/test_plan_published.py) hold the presets' bands to the
planner; here the fit and leave-one-out are checked where the answer is known in closed form.
"""

from __future__ import annotations

import pytest

from mesh3d.planner.held_out import (
    HeldOutBand,
    balanced_fraction,
    covering_band,
    held_out_band,
    leave_one_out,
)

# run -> (compute seconds at a fraction of 1, seconds that do not scale, the fraction it "ran" at)
RUNS = {"a": (1.0, 0.1, 0.40), "b": (1.3, 0.0, 0.44), "c": (0.8, 0.3, 0.36)}


def error_at(run: str, fraction: float) -> float:
    compute, rest, ran_at = RUNS[run]
    return (compute / ran_at + rest) / (compute / fraction + rest) - 1


def test_the_fit_balances_the_largest_over_and_under_prediction():
    fraction = balanced_fraction(error_at, list(RUNS))
    errors = [error_at(run, fraction) for run in RUNS]
    assert max(errors) + min(errors) == pytest.approx(0, abs=1e-5)
    # anywhere else the largest |error| is larger
    for other in (fraction * 0.98, fraction * 1.02):
        assert max(abs(error_at(run, other)) for run in RUNS) > max(map(abs, errors))


def test_one_run_fits_itself():
    assert balanced_fraction(error_at, ["b"]) == pytest.approx(0.44, abs=1e-4)


def test_leave_one_out_predicts_each_run_at_the_others_fit():
    held = leave_one_out(error_at, ["a", "b", "c"])
    for run in RUNS:
        others = [r for r in RUNS if r != run]
        assert held[run] == pytest.approx(error_at(run, balanced_fraction(error_at, others)))
    # a run the fit never saw stands at the fraction given, else at the fit of all
    assert leave_one_out(error_at, ["a", "b"], ["c"], 0.5)["c"] == error_at("c", 0.5)
    assert leave_one_out(error_at, ["a", "b"], ["c"])["c"] == pytest.approx(
        error_at("c", balanced_fraction(error_at, ["a", "b"]))
    )


def test_held_out_errors_stand_farther_than_in_sample_ones():
    fraction = balanced_fraction(error_at, list(RUNS))
    band = held_out_band(leave_one_out(error_at, list(RUNS)), {r: error_at(r, fraction) for r in RUNS})
    assert band.runs == 3 and band.low < 0 < band.high
    assert band.in_sample < band.largest


def test_a_band_is_rounded_outwards_and_covered():
    band = held_out_band({"a": -0.0701, "b": 0.0809}, {"a": 0.0641})
    assert band == HeldOutBand(low=-0.071, high=0.081, runs=2, in_sample=0.065)
    assert covering_band(band) == 0.09
    assert band.text() == "-7.1 %/+8.1 % (held out, leave-one-out over 2 published runs; in-sample ±6.5 %)"


def test_refusals():
    with pytest.raises(ValueError, match="no runs"):
        balanced_fraction(error_at, [])
    with pytest.raises(ValueError, match="two fitted runs"):
        leave_one_out(error_at, ["a"])
    with pytest.raises(ValueError, match="outside fractions"):
        balanced_fraction(error_at, ["a"], bounds=(0.5, 0.9))
