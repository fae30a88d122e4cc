"""An attention that writes its score matrix out is charged the bytes it moves through it
(meters.ScoreMatrixBytes), a fused one nothing: counted pass by pass against the ops a GPU runs,
and the step's time grows by exactly those bytes at the achievable memory bandwidth."""

from __future__ import annotations

import functools

import pytest
import torch

import mesh3d
from mesh3d.planner import constants as C
from mesh3d.planner.hardware import HARDWARE
from mesh3d.planner.measure.measured_stages import planner_anatomy
from mesh3d.planner.measure.probe import measure_model

transformers = pytest.importorskip("transformers")

SEQ, HEADS, BATCH = 32, 4, 2


def written_out_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Scores written by one matmul, a softmax and a dropout over them, a matmul reading them."""
    scores = torch.matmul(query, key.transpose(2, 3))
    probs = torch.nn.functional.dropout(torch.softmax(scores, dim=-1), p=0.1, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register("written_out_for_test", written_out_attention)


def llama(attention: str, dropout: float = 0.0) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        intermediate_size=128,
        vocab_size=96,
        max_position_embeddings=SEQ,
        attention_dropout=dropout,
    )
    config._attn_implementation = attention
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


@functools.cache
def costs_of(attention: str, dropout: float = 0.0):
    model = llama(attention, dropout)
    return measure_model(
        model,
        planner_anatomy(model, SEQ),
        tp=1,
        tp_plan=None,
        microbatch_size=BATCH,
        seq_len=SEQ,
        param_dtype=torch.bfloat16,
    )


def test_a_written_out_score_matrix_is_counted_pass_by_pass():
    block = costs_of("written_out_for_test").block
    one_pass = BATCH * HEADS * SEQ * SEQ * 2  # a bf16 score matrix read or written once
    # forward: the matmul writes it, the softmax reads and writes, the dropout (one kernel with a
    # byte mask, as on a GPU) reads and writes, the second matmul reads
    assert block.forward_score_bytes == 6 * one_pass
    # backward: the second matmul's gradient written and the probabilities read for dV, dropout's
    # and softmax's backward (2 and 3), the gradient read twice for dQ and dK
    assert block.score_bytes - block.forward_score_bytes == 9 * one_pass


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_sdpa_writes_no_score_matrix_with_or_without_dropout(dropout):
    """SDPA with dropout takes the math kernel on a CPU; the probe runs it as a GPU's flash kernel."""
    costs = costs_of("sdpa", dropout)
    assert costs.block.score_bytes == costs.first_end.score_bytes == costs.last_end.score_bytes == 0


def test_the_step_grows_by_the_bytes_at_the_memory_bandwidth():
    """One microbatch of the whole batch on one rank: the forward grows by exactly its bytes (same
    FLOPs); the step by every byte, beside the backward's FLOPs that differ (SDPA's backward counts
    the scores' recomputation)."""
    fix = dict(pp=1, dp=1, tp=1, microbatches=1, activation_checkpoint="never", param_dtype=torch.bfloat16)
    hardware = HARDWARE["a100-80gb"]
    stream = hardware.memory_bandwidth * C.ACHIEVABLE_MEMORY_FRACTION
    rate = hardware.peak_flops * hardware.achievable_fraction

    def plan(attention):
        return mesh3d.plan(llama(attention), gpus=1, hardware=hardware, seq_len=SEQ, global_batch=BATCH, fix=fix)[0]

    fused, written = plan("sdpa").time, plan("written_out_for_test").time
    fused_block, block = costs_of("sdpa").block, costs_of("written_out_for_test").block
    blocks = 4
    assert written.forward_seconds[0] - fused.forward_seconds[0] == pytest.approx(
        blocks * block.forward_score_bytes / stream, rel=1e-6
    )
    assert written.seconds - fused.seconds == pytest.approx(
        blocks * (block.score_bytes / stream + (block.flops - fused_block.flops) / rate), rel=1e-6
    )
