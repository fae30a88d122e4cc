"""train.py warns when its learning rate never decays: --steps within --warmup (examples/llama/optimization.py)."""

import argparse

from examples.llama.optimization import schedule_warning


def _args(steps: int, warmup: int = 20) -> argparse.Namespace:
    return argparse.Namespace(steps=steps, warmup=warmup, lr=3e-3, lr_schedule_steps=None, min_lr_ratio=0.1)


def test_a_run_inside_its_warmup_is_warned_of():
    said = schedule_warning(_args(3))
    assert said.startswith("warning: --steps 3 ends inside the --warmup 20 steps: the lr only rises, to 4.50e-04")
    assert "never reaching --lr 0.003 nor decaying; pass --warmup 1 (or --steps above 20)" in said


def test_a_run_that_ends_at_its_peak_is_warned_of():
    said = schedule_warning(_args(20))
    assert said.startswith("warning: --steps 20 ends as the --warmup 20 steps do: the run ends at the peak lr (0.003)")
    assert "pass --warmup 2 (or --steps above 20)" in said


def test_a_run_that_decays_is_not():
    assert schedule_warning(_args(21)) is None and schedule_warning(_args(200)) is None
