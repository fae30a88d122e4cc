"""train.py --hf-model qwen3_moe --router-aux-loss COEF: the router's load-balancing loss on (off by
the architecture's default), its term in the metrics beside the cross-entropy; one process, 2 steps.
Refused for a model without a router loss (qwen2), and without --hf-model."""

import json

import pytest
from train_launch import run_train

pytest.importorskip("transformers")

TINY = ["--n-layers", "2", "--seq-len", "16", "--global-batch", "4", "--steps", "2"]


def test_the_router_loss_is_trained_and_logged(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    run_train(["--hf-model", "qwen3_moe", "--router-aux-loss", "0.02", *TINY, "--metrics", str(metrics)], timeout=300)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    for r in records:
        assert r["router_aux"] > 0 and abs(r["cross_entropy"] + r["router_aux"] - r["loss"]) < 1e-4, r


def test_a_model_without_a_router_loss_is_refused():
    done = run_train(["--hf-model", "qwen2", "--router-aux-loss", "0.02", *TINY, "--metrics", ""], check=False)
    assert done.returncode == 2 and "--hf-model qwen2 (Qwen2Config) has no router load-balancing loss" in done.stderr
    done = run_train(["--router-aux-loss", "0.02", *TINY, "--metrics", ""], check=False)
    assert done.returncode == 2 and "--router-aux-loss 0.02 needs --hf-model" in done.stderr
