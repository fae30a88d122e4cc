"""train.py --hf-model: a Hugging Face model trained with the example's flags, written back as itself.

- `--hf-model qwen2` (the architecture at the debug config's sizes), the README-style command at
  (pp, dp, tp) = (2, 1, 2) on 4 ranks (tensor parallelism from Qwen2's own plan), with
  checkpoints, held-out eval and --export-hf: the loss falls; its step-14 checkpoint resumed in one
  process (pp 2 -> 1) gives steps 15-16 the same losses (1e-4, as test_train_checkpoint.py); both
  exports load in transformers as Qwen2ForCausalLM with equal logits.
- The issue's Qwen2 case: a Qwen2 checkpoint (q/k/v biases) given to the LLaMA example with
  --init-from-hf is refused, naming the biases; with --hf-model the same directory is imported and
  exported exactly as Qwen2 (logits equal the original's, 1e-5).
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
from hf_cases import TOLERANCE, VOCAB, hf_model
from test_torchrun import TIMEOUT_S, _assert_close, _losses
from train_launch import run_train

transformers = pytest.importorskip("transformers")

TRAIN = ["--seq-len", "32", "--global-batch", "8", "--log-every", "4", "--warmup", "4"]


def _run(*args: str, torchrun: int = 0, check: bool = True) -> subprocess.CompletedProcess:
    """train.py in one process, or on `torchrun` ranks as torchrun starts them (tests/train_launch.py)."""
    return run_train([*TRAIN, *args], nproc=torchrun, timeout=TIMEOUT_S, check=check)


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens).logits


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_hf_model_by_architecture_trains_resumes_and_exports(tmp_path):
    common = [
        "--hf-model",
        "qwen2",
        "--steps",
        "16",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--eval-every",
        "8",
        "--eval-batches",
        "1",
    ]
    first = _run(
        *common,
        "--pp",
        "2",
        "--tp",
        "2",
        "--checkpoint-every",
        "14",
        "--metrics",
        str(tmp_path / "a.jsonl"),
        "--export-hf",
        str(tmp_path / "a"),
        torchrun=4,
    )
    assert "model Qwen2 (Hugging Face, qwen2) at --config debug's sizes" in first.stdout
    losses = _losses(tmp_path / "a.jsonl")
    assert losses[0] == pytest.approx(np.log(256), rel=0.05)
    assert np.mean(losses[-3:]) < losses[0] - 1.0, losses
    assert "eval_loss" in first.stdout

    _run(
        *common,
        "--resume-from",
        str(tmp_path / "ckpt" / "step14"),
        "--metrics",
        str(tmp_path / "b.jsonl"),
        "--export-hf",
        str(tmp_path / "b"),
    )
    _assert_close(_losses(tmp_path / "b.jsonl"), losses[14:])

    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    a, b = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name) for name in "ab")
    assert type(a).__name__ == type(b).__name__ == "Qwen2ForCausalLM"
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (128, 8, 256)  # debug's
    assert _relative(_logits(b, tokens), _logits(a, tokens)) <= 1e-4


def test_a_qwen2_checkpoint_is_refused_by_the_llama_example_and_kept_whole_by_hf_model(tmp_path):
    original = hf_model("qwen2")  # tied, with q/k/v biases (non-zero), vocabulary 96
    original.save_pretrained(tmp_path / "qwen2")
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(3, VOCAB, size=4096, dtype=np.int64))
    data = ["--token-file", str(tokens), "--seq-len", "8"]

    refused = _run("--init-from-hf", str(tmp_path / "qwen2"), "--steps", "1", *data, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "holds 12 tensor(s) this model has no place for ('model.layers.0.self_attn.k_proj.bias'" in refused.stderr
    assert f"pass --hf-model {tmp_path / 'qwen2'}" in refused.stderr

    _run(
        "--hf-model",
        str(tmp_path / "qwen2"),
        "--pp",
        "2",
        "--steps",
        "0",
        *data,
        "--metrics",
        str(tmp_path / "m.jsonl"),
        "--export-hf",
        str(tmp_path / "export"),
        torchrun=2,
    )
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert type(exported) is type(original) and exported.config.tie_word_embeddings
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    assert _relative(_logits(exported, ids), _logits(original, ids)) <= TOLERANCE
