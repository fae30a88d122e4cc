"""The planner held to the code before renting (issue 66), from the two commands a user runs:
`train.py --dry-run N` plays ranks of an N-rank job of its flags on this CPU and `mesh3d-plan
--verify` the best plan's, each printing every played rank's bytes beside the planner's and a
verdict line, exit 0 where they agree (tests/unit/test_dry_run_verdict.py: 1 where they do not);
a setting parallelize refuses is one `error:` line, as train.py's other errors are.
"""

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_train(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`python examples/llama/train.py ...` as a user runs it: the dry run starts processes of its
    own, which the suite's forked (daemonic) ranks may not."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "examples/llama/train.py", *argv]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


TINY = ["--n-layers", "4", "--dim", "64", "--n-heads", "4", "--n-kv-heads", "2", "--seq-len", "32"]


def test_train_dry_run_reports_each_rank_beside_the_planner():
    done = run_train(
        ["--dry-run", "16", "--pp", "2", "--tp", "2", *TINY, "--global-batch", "16", "--dry-run-ranks", "0", "15"],
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "rank 0 of 16 (pp 0, dp 0, tp 0)" in out and "rank 15 of 16 (pp 1, dp 3, tp 1)" in out
    for kind in ("dp", "pipeline", "tp"):
        assert f"sent on {kind} per step:" in out
    unpredicted = [line for line in out.splitlines() if "sent on" in line and "planner: -" in line]
    assert all("default_pg" in line for line in unpredicted)  # only the agreements' few world bytes
    assert "verify: the planner's parameter, gradient and optimizer bytes and the bytes each group sends equal" in out


def test_train_dry_run_says_a_refused_setting_once():
    done = run_train(
        ["--dry-run", "16", "--tp", "8", *TINY, "--global-batch", "16", "--dry-run-ranks", "0"], timeout=300
    )
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]
    assert errors == ["error: --dry-run 16: tp=8 does not divide n_heads=4 of Transformer; choose tp among [1, 2]"]
    assert "Traceback" not in done.stdout + done.stderr


def test_plan_verify_dry_runs_the_best_plan(tmp_path):
    transformers = pytest.importorskip("transformers")
    from mesh3d.planner import cli

    transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=256,
    ).save_pretrained(tmp_path)
    argv = ["--model", str(tmp_path / "config.json"), "--gpus", "16", "--seq-len", "128", "--global-batch", "32"]
    argv += ["--fix", "pp=2", "--fix", "tp=2", "--fix", "schedule=1f1b", "--verify", "--verify-ranks", "0", "15"]
    argv += ["--verify-seq-len", "32"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    text = out.getvalue()
    assert "Verifying #1 on this CPU at seq_len 32" in text
    assert "rank 0 of 16 (pp 0, dp 0, tp 0)" in text and "rank 15 of 16 (pp 1, dp 3, tp 1)" in text
    assert "sent on tp per step:" in text and "sent on pipeline per step:" in text
    assert "verify: the planner's parameter, gradient and optimizer bytes and the bytes each group sends equal" in text
