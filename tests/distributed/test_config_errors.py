"""A bad configuration at 8 ranks: its message printed once, by rank 0, in flags; every rank exits 2.

Both kinds: ones argparse finds (`--resume` without `--checkpoint-dir`; `--grad-clip` given with a
never-drain schedule, which has no whole gradient to clip; a `--global-batch` whose share per dp
rank `--microbatches` does not divide) and one mesh3d.parallelize
raises on every rank before any collective (a 1F1B schedule with fewer microbatches than pp
stages), whose `schedule=`/`microbatches=`/`pp=` the trainer writes as the flags the user typed.
That one runs under torchrun (8 fresh interpreters: the process group made, then left by every
rank); argparse's, found before any group exists, on 8 ranks forked as torchrun would start them
(tests/train_launch.py: the same output and exit statuses, without 8 interpreters' imports each).
"""

import subprocess
import sys

import pytest
from test_torchrun import ROOT, TIMEOUT_S, _env
from train_launch import run_train

from examples.llama.config_errors import in_user_terms

TRAIN = [
    "examples/llama/train.py",
    "--pp",
    "2",
    "--dp",
    "2",
    "--tp",
    "2",
    "--seq-len",
    "16",
    "--n-layers",
    "4",
    "--steps",
    "1",
    "--metrics",
    "",
]


@pytest.mark.parametrize(
    "flags, message, not_said",
    [
        (["--resume"], "train.py: error: --resume needs --checkpoint-dir", None),
        (
            ["--schedule", "1f1b", "--microbatches", "1"],
            "got --microbatches 1 with --pp 2; use at least 2 microbatches (or --schedule gpipe)",
            "microbatches=1",
        ),
        (  # found with the flags, not by pm.step on every rank
            ["--global-batch", "10"],
            "train.py: error: --global-batch 10 over --dp 2 gives 5 samples per rank, which --microbatches 2 (the "
            "default: --pp) does not divide; use --global-batch 8 or 12",
            "microbatches=2",
        ),
        (
            ["--schedule", "pipedream_2bw", "--grad-clip", "1.0"],
            "train.py: error: --grad-clip 1.0 cannot apply with --schedule pipedream_2bw: "
            "its stages update at different times, so no whole gradient exists to clip by its global norm; "
            "leave --grad-clip out (or pass --grad-clip 0)",
            None,
        ),
    ],
)
def test_a_bad_configuration_at_8_ranks_is_said_once(flags, message, not_said):
    if "--microbatches" in flags:  # raised by mesh3d.parallelize: under torchrun itself
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8", *TRAIN, *flags]
        done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    else:
        done = run_train([*TRAIN[1:], *flags], nproc=8, timeout=TIMEOUT_S, check=False)
        assert done.rank_returncodes == [2] * 8, done.rank_returncodes
    said = done.stdout + done.stderr
    assert done.returncode != 0, said[-3000:]
    assert said.count(message) == 1, said[-6000:]
    # No rank's traceback (torchrun's agent still prints its own failure block, ChildFailedError).
    assert 'train.py", line' not in said and "ValueError" not in said, said[-6000:]
    assert not_said is None or not_said not in said, said[-6000:]


def test_library_parameters_become_flags():
    flags = {
        "schedule": "--schedule",
        "microbatches": "--microbatches",
        "pp": "--pp",
        "loss_parallel": "--loss-parallel",
        "virtual_stages": "--virtual-stages",
        "global_batch_size": "--global-batch",
    }
    assert (
        in_user_terms("needs microbatches >= pp, got microbatches=1 with pp=2 (or schedule='gpipe')", flags)
        == "needs microbatches >= pp, got --microbatches 1 with --pp 2 (or --schedule gpipe)"
    )
    assert (
        in_user_terms("loss_parallel=True with virtual_stages=None; pp*tp=4", flags)
        == "--loss-parallel with no --virtual-stages; pp*tp=4"
    )
    assert in_user_terms("global_batch_size=10 must divide", flags) == "--global-batch 10 must divide"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pp", "3"], "error: build_mesh: --dp -1 takes the rest of the world, but pp*tp=3 does not divide"),
        (["--pp", "2", "--data", "no-such-corpus.txt"], "error: data files not found: ['no-such-corpus.txt']"),
    ],
)
def test_under_torchrun_every_rank_exits_2_with_the_one_line(flags, message):
    """The error is raised on every rank (before the process group, or after it); the ranks leave
    together (exit_together.py), so torchrun's summary lists each with exit code 2, none stopped
    by SIGTERM, and the one line is all the ranks print, above torchrun's own report."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += ["examples/llama/train.py", "--n-layers", "2", "--seq-len", "16", "--steps", "1", *flags]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said[-3000:]  # torchrun's own status when a worker failed
    assert said.count(message) == 1 and done.stderr.startswith(message), said[-6000:]
    # torchrun may still send SIGTERM to ranks it saw running; they leave with 2 all the same.
    assert said.count("exitcode  : 2 ") == 4 and "exitcode  : -" not in said, said[-6000:]
    assert 'train.py", line' not in said and done.stdout == "", said[-6000:]
