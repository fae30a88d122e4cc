"""mesh3d.train's progress line: human units, elapsed time and ETA, FLOPs counted, MFU or "n/a"."""

from __future__ import annotations

import math

import pytest
import torch

from examples.llama.config import get_config
from examples.llama.model import Transformer
from mesh3d.train import Progress, flops_per_token, human_count, human_duration, mfu, peak_flops
from mesh3d.train.flops import peak_flops_of


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0"),
        (950, "950"),
        (12_345, "12.3k"),
        (40_000, "40.0k"),
        (999_960, "1.0M"),
        (4_100_000, "4.1M"),
        (31_500_000, "31.5M"),
        (2e9, "2.0B"),
        (3.2e12, "3.2T"),
        (-1500, "-1.5k"),
    ],
)
def test_counts_in_human_units(n, text):
    assert human_count(n) == text


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0.04, "0.0s"),
        (4.23, "4.2s"),
        (42, "42s"),
        (59.6, "1m00s"),
        (65, "1m05s"),
        (3599, "59m59s"),
        (7380, "2h03m"),
        (100_800, "1d04h"),
        (math.inf, "?"),
    ],
)
def test_durations_in_human_units(seconds, text):
    assert human_duration(seconds) == text


def _meta_llama(seq_len: int, tied: bool = False) -> Transformer:
    with torch.device("meta"):
        return Transformer(get_config("debug", max_seq_len=seq_len, tie_embeddings=tied))


@pytest.mark.parametrize("seq_len, tied", [(128, False), (64, True)])
def test_flops_are_counted_as_the_formula_says(seq_len, tied):
    """Forward + backward of a decoder = 6 FLOPs per matmul weight per token (the embedding is a
    lookup, norm gains no matmul) + attention's scores and weighted sum, 2 * 2 * seq * dim per layer
    forward, 3 times that with backward (the count is of full, unmasked attention, as SDPA computes)."""
    model = _meta_llama(seq_len, tied)
    a = model.args
    matmul_weights = sum(
        p.numel() for name, p in model.named_parameters() if p.ndim == 2 and not name.startswith("tok_embeddings")
    )
    if tied:  # the output head is the embedding: its matmul counts once
        matmul_weights += a.vocab_size * a.dim
    want = 6 * matmul_weights + 12 * a.n_layers * seq_len * a.dim
    assert flops_per_token(model, seq_len) == want
    assert all(p.grad is None for p in model.parameters())  # nothing left on the model


def test_routed_experts_count_the_tokens_they_take():
    # transformers' grouped-mm experts: each token meets top-k experts, each costing a gate_up and a
    # down matmul (2 x hidden x 3 x intermediate forward, 3 times that with backward); doubling the
    # experts' width adds exactly that much per token, whatever else the model counts.
    pytest.importorskip("transformers")
    import hf_cases

    def count(width: int) -> float:
        return flops_per_token(hf_cases.meta_hf_model("qwen3_moe", moe_intermediate_size=width), 8)

    config = hf_cases.hf_config("qwen3_moe")
    per_width = 3 * 2 * config.hidden_size * 3 * config.num_experts_per_tok * config.num_hidden_layers
    assert count(64) - count(32) == per_width * 32


def test_flops_need_the_meta_model():
    model = Transformer(get_config("debug", n_layers=1, max_seq_len=8))
    with pytest.raises(ValueError, match="meta device"):
        flops_per_token(model, 8)


def test_peak_flops_table_and_unknown_devices():
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_of("NVIDIA H100 NVL") == 835e12
    assert peak_flops_of("NVIDIA H200") == 989e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_of("NVIDIA B200") == 2.25e15
    assert peak_flops_of("NVIDIA GeForce RTX 4090") is None
    assert peak_flops(torch.device("cpu")) is None
    assert mfu(1e9, 1000.0, None, 8) is None
    assert mfu(1e9, 1000.0, 1e12, 8) == pytest.approx(1e12 / 8e12)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA GB200", 2.5e15),  # not B200's, though its name holds "B200"
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA B300 SXM6 AC", 2.25e15),
        ("NVIDIA GB300", 2.5e15),
        ("NVIDIA H800", 989e12),  # not H100's row, and no longer unknown
        ("NVIDIA H800 PCIe", 756e12),
        ("NVIDIA H20", 148e12),  # not H200's, though "H200" starts with "H20"
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L40", None),  # not L40S's: an unknown device has no peak
        ("NVIDIA A100 80GB PCIe", 312e12),
    ],
)
def test_peak_flops_names_match_whole_words(name, peak):
    assert peak_flops_of(name) == peak


def test_the_progress_line():
    progress = Progress(
        total_steps=100,
        tokens_per_step=2048,
        start_step=40,
        flops_per_token=6e6,
        peak_flops=None,
        world_size=8,
        device="cpu",
    )
    progress.started -= 30.0  # 30 s into the run, 10 steps done: 3 s a step, 50 left
    line = progress.line(50, loss=2.5, lr=1e-3, grad_norm=0.5, step_seconds=2.048)
    assert line.startswith("step    50  loss 2.5000  lr 1.00e-03  grad_norm 0.500  elapsed 30s")
    assert "eta 2m30s" in line and "tokens/s 1.0k" in line and line.endswith("MFU n/a (peak FLOP/s unknown for cpu)")
    progress.peak_flops = 1e9  # 1000 tokens/s * 6e6 FLOPs over 8 devices of 1 GFLOP/s each
    assert progress.line(50, 2.5, 1e-3, 0.5, 2.048).endswith("tokens/s 1.0k  MFU 75.0%")
    assert "MFU" not in Progress(10, 2048).line(1, 2.5, 1e-3, 0.5, 1.0)  # no FLOP count: no MFU
    # A never-drain schedule has no whole gradient: no grad_norm column.
    assert Progress(10, 2048).line(1, 2.5, 1e-3, None, 1.0).startswith("step     1  loss 2.5000  lr 1.00e-03  elapsed")
