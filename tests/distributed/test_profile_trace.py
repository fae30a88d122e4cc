"""--profile's traces show the schedule: each step a ProfilerStep#N span (N the training step) and
each pipeline action a span named by its kind, stage and microbatch, sends and receives with their
peer; kineto's USDT start/stop lines silenced. 2 ranks at pp=2 (1F1B, 2 microbatches), steps 2-3."""

import json

from train_launch import run_train


def test_the_trace_names_steps_stages_microbatches_and_actions(tmp_path):
    argv = ["--pp", "2", "--schedule", "1f1b", "--n-layers", "2", "--seq-len", "16", "--global-batch", "4"]
    argv += ["--steps", "3", "--metrics", "", "--profile", str(tmp_path), "--profile-steps", "2:3"]
    done = run_train(argv, nproc=2, timeout=120)
    assert "USDT" not in done.stdout + done.stderr, done.stderr[-3000:]
    expected = {
        0: ["F stage 0 mb 1", "B stage 0 mb 0", "send F stage 0 mb 1 -> pp 1", "recv B stage 0 mb 1 <- pp 1"],
        1: ["F stage 1 mb 0", "B stage 1 mb 1", "recv F stage 1 mb 0 <- pp 0", "send B stage 1 mb 1 -> pp 0"],
    }
    for rank, spans in expected.items():
        names = {e.get("name") for e in json.loads((tmp_path / f"rank{rank}.json").read_text())["traceEvents"]}
        assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names, rank
        assert set(spans) <= names, (rank, sorted(n for n in names if "stage" in str(n)))
