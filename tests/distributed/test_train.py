"""The single-process training example: LR schedule, metrics file, and a loss that falls.

Also `train.py --param-dtype bf16` in one process (its JSONL lines say bf16). This file,
test_train_text.py and test_train_checkpoint.py run train.py's main in processes of their own,
forked as tests/train_launch.py does.
"""

import json
import math
import subprocess

import pytest
import torch
from train_launch import run_train

import mesh3d
from examples.llama.config import get_config
from examples.llama.model import Transformer
from examples.llama.optimization import lr_at


def test_warmup_then_cosine():
    kw = dict(peak=1.0, warmup=10, total=110, min_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert all(lr_at(s, **kw) >= lr_at(s + 1, **kw) for s in range(10, 120))


def _train(*flags: str) -> subprocess.CompletedProcess:
    """train.py in one process, as `python train.py` runs (tests/train_launch.py)."""
    return run_train(list(flags), timeout=300)


def test_training_script_loss_falls(tmp_path):
    """The README's command, shortened: from ~ln(256) to well below it, with a JSONL line per step."""
    metrics = tmp_path / "metrics.jsonl"
    done = _train("--steps", "40", "--warmup", "10", "--log-every", "10", "--metrics", str(metrics))
    assert "step    11  loss" in done.stdout and "tokens/s" in done.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert set(records[0]) == {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "elapsed_s",
        "param_dtype",
        "compile",
        "restart",
        "skipped",
        "tokens",
        "memory_rise_gib",
        "memory_peak_gib",
        "memory_peak_rank",
        "memory_rise_gib_by_rank",
        "memory_baseline_gib_by_rank",
    }
    assert 0 < records[0]["memory_peak_gib"] < 4 and records[0]["memory_peak_rank"] == 0
    assert records[0]["restart"] == 0 and records[0]["skipped"] is False
    assert [r["tokens"] for r in records[:2]] == [16 * 128, 2 * 16 * 128]
    assert records[0]["param_dtype"] == "fp32" and records[0]["compile"] is False
    assert records[0]["loss"] == pytest.approx(math.log(256), rel=0.03)
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert last < records[0]["loss"] - 2.0, [r["loss"] for r in records]


def test_training_script_in_bf16(tmp_path):
    """--param-dtype bf16 in one process (mixed precision without data parallelism): the JSONL says so.
    With --predict-memory the planner's figure for the layout is said beside the first step's peak,
    and is the one mesh3d.plan gives pinned to that layout; with --fused-loss, the head and loss fused."""
    metrics = tmp_path / "metrics.jsonl"
    flags = ("--steps", "3", "--seq-len", "32", "--param-dtype", "bf16", "--metrics", str(metrics))
    done = _train(*flags, "--predict-memory", "--fused-loss")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["param_dtype"] for r in records] == ["bf16"] * 3
    with torch.device("meta"):
        model = Transformer(get_config("debug", max_seq_len=32, vocab_size=256))
    fix = dict(pp=1, dp=1, tp=1, schedule="interleaved_1f1b", virtual_stages=1, microbatches=1)
    fix.update(activation_checkpoint="never", dp_mode="fsdp", param_dtype=torch.bfloat16, compile=False)
    fix["fused_loss"] = True
    planned = mesh3d.plan(model, gpus=1, seq_len=32, global_batch=16, memory_limit=2**60, fix=fix)[0]
    assert records[0]["memory_predicted_gib"] == pytest.approx(planned.memory_per_rank.total / 2**30)
    assert all("memory_predicted_gib" not in r for r in records[1:])
    line = (
        f"memory: predicted {planned.memory_per_rank.total / 2**30:.2f} GiB (mesh3d.plan, the fullest rank), measured "
    )
    assert line in done.stdout
    assert records[0]["loss"] == pytest.approx(math.log(256), rel=0.03)
