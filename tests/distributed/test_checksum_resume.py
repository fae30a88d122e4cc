"""Checkpoints changed in place, sizes kept (issue 25): `--resume` passes over them, exactly.

examples/llama/train.py at (pp, dp, tp) = (2, 1, 1) on 2 ranks, a checkpoint every 4 steps.
An undamaged run of 16 steps gives the reference losses and final weights (exported as
safetensors). Its step4, step8 and step12 checkpoints are what a 12-step run saves (the warmup is
longer than the run, so the learning rate never depends on --steps). Copies of them are damaged
by flipping 64 bytes in the middle of a file, sizes kept, and `--resume --steps 16` is run:

- the largest .distcp file of step12 (the issue's scenario): it resumes from step8;
- step12's train_state.json and step8's DCP .metadata: it resumes from step4, naming both.

The log names each damaged file; the losses of the steps trained again and the final weights
equal the undamaged run's (relative 1e-5: the same layout sums in the same order). A damaged
checkpoint given by --resume-from is refused, naming the file, without a hang.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_restart import TOLERANCE, assert_same_weights
from train_launch import run_train

TRAIN = [
    "--pp",
    "2",
    "--seq-len",
    "32",
    "--global-batch",
    "4",
    "--n-layers",
    "2",
    "--warmup",
    "100",
    "--log-every",
    "1",
    "--checkpoint-every",
    "4",
]
TIMEOUT_S = 480


def _train(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """train.py on 2 ranks started as torchrun would (tests/train_launch.py)."""
    return run_train([*TRAIN, *args], nproc=2, timeout=TIMEOUT_S, check=check)


def _losses(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}


def _flip_middle(file: Path) -> None:
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.seek(size // 2 - 32)
        flipped = bytes(b ^ 0xFF for b in f.read(64))
        f.seek(size // 2 - 32)
        f.write(flipped)
    assert file.stat().st_size == size


@pytest.fixture(scope="module")
def undamaged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("undamaged")
    _train(
        "--steps",
        "16",
        "--checkpoint-dir",
        str(tmp / "ckpt"),
        "--metrics",
        str(tmp / "metrics.jsonl"),
        "--export-hf",
        str(tmp / "final"),
    )
    return tmp / "ckpt", _losses(tmp / "metrics.jsonl"), load_file(tmp / "final" / "model.safetensors")


def _twelve_step_run(ckpt: Path, root: Path) -> Path:
    for name in ("step4", "step8", "step12"):
        shutil.copytree(ckpt / name, root / "ckpt" / name)
    return root / "ckpt"


@pytest.mark.parametrize("case", ["data file of step12", "train state of step12 and metadata of step8"])
def test_resume_passes_over_a_checkpoint_changed_in_place(tmp_path, undamaged, case):
    ckpt, want_losses, want_weights = undamaged
    root = _twelve_step_run(ckpt, tmp_path)
    if case == "data file of step12":
        victims = [max((root / "step12").glob("*.distcp"), key=lambda p: p.stat().st_size)]
        resumed_from = 8
    else:
        victims = [root / "step12" / "train_state.json", root / "step8" / ".metadata"]
        resumed_from = 4
    for victim in victims:
        _flip_middle(victim)

    metrics = tmp_path / "metrics.jsonl"
    done = _train(
        "--steps",
        "16",
        "--resume",
        "--checkpoint-dir",
        str(root),
        "--metrics",
        str(metrics),
        "--export-hf",
        str(tmp_path / "final"),
    )
    for victim in victims:
        said = [line for line in done.stdout.splitlines() if line.startswith(f"cannot resume from {victim.parent}:")]
        assert len(said) == 1 and str(victim) in said[0] and "checksum" in said[0], done.stdout[-3000:]
    assert f"resumed from {root / f'step{resumed_from}'} (step {resumed_from})" in done.stdout

    got = _losses(metrics)
    assert sorted(got) == list(range(resumed_from + 1, 17))
    errors = {s: abs(got[s] - want_losses[s]) / abs(want_losses[s]) for s in got}
    assert max(errors.values()) <= TOLERANCE, (got, want_losses)
    assert_same_weights(tmp_path / "final", want_weights)


def test_a_damaged_checkpoint_named_by_resume_from_is_refused(tmp_path, undamaged):
    root = _twelve_step_run(undamaged[0], tmp_path)
    victim = max((root / "step12").glob("*.distcp"), key=lambda p: p.stat().st_size)
    _flip_middle(victim)
    done = _train(
        "--steps",
        "16",
        "--resume-from",
        str(root / "step12"),
        "--checkpoint-dir",
        str(root),
        "--metrics",
        "",
        check=False,
    )
    assert done.returncode != 0, done.stdout[-3000:]
    assert str(victim) in done.stderr and "another checksum than when it was written" in done.stderr, done.stderr[
        -6000:
    ]
