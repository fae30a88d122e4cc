"""The planner's predictions against published bf16 training runs (docs/plan.md has the table).

Each case pins the published layout in `fix=` so one candidate is evaluated; the model is built on
meta and measured on fake tensors, so even 70B shapes take seconds. The bound is 20 % on tokens/s
per GPU: the planner's constants are few and named (planner/constants.py), never fitted per run.

Sources (quoted in docs/plan.md):
- torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (Llama 3.1 8B, 8 H100, FSDP);
- torchtitan PR #1299 (Llama 3.1 70B, 256 H100, FSDP 32 x TP 8, compile, full AC);
- torchtitan docs/performance.md before PR #800 (Llama 2 13B, 64 A100, FSDP, no AC);
- Narayanan et al. 2021 (Megatron-LM), Table 1 (GPT 3.6B / 7.5B / 39.1B on A100, full recompute);
- torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 2 (Llama 3.1 8B, 8 H100, FSDP x CP
  at 32k-262k tokens): context parallelism, below.
"""

from __future__ import annotations

import pytest
import torch

import mesh3d
from mesh3d.planner.hardware import GB, GIB, Hardware

pytest.importorskip("transformers")
import transformers  # noqa: E402

# torchtitan's H100s are not the SXM5 preset: 96 GB HBM2e at 2.4 TB/s, run at a 500 W power limit;
# torchtitan says their peak lies "between SXM and NVL" and is not known. The midpoint of the two
# datasheets' dense BF16 (989 and 835 TFLOP/s) is taken, not a value fitted to any run.
TORCHTITAN_H100 = Hardware(
    "h100-96gb-hbm2e-500w",
    peak_flops=(989e12 + 835e12) / 2,
    memory_bytes=96 * GB,
    intra_node_bandwidth=450 * GB,
    inter_node_bandwidth=50 * GB,
    memory_bandwidth=2400 * GB,
    source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 96 GB HBM2e, 2.4 TB/s, 500 W, "
    "400 Gb/s RDMA per GPU; peak between H100 SXM (989) and NVL (835 TFLOP/s dense BF16)",
)


def gpt_as_llama(hidden: int, layers: int, heads: int) -> transformers.LlamaConfig:
    """A GPT shape (Megatron's Table 1: vocab 51,200, MHA, a 4h two-matrix MLP) as a LlamaConfig:
    SwiGLU's three matrices of 8h/3 (rounded to a multiple of 64) have the FLOPs of GPT's two of 4h."""
    ffn = round(8 * hidden / 3 / 64) * 64
    return transformers.LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=ffn,
        vocab_size=51200,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def llama2_13b() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        intermediate_size=13824,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def predict(model, gpus, hardware, seq_len, global_batch, **layout):
    fix = dict(virtual_stages=1, dp_mode="fsdp", param_dtype=torch.bfloat16, compile=False)
    fix.update(layout)
    plans = mesh3d.plan(
        model, gpus=gpus, hardware=hardware, seq_len=seq_len, global_batch=global_batch, memory_limit="10TiB", fix=fix
    )  # memory is checked where it was published
    assert len(plans) == 1, [p.row() for p in plans]
    return plans[0]


# (name, published tokens/s/GPU, model, gpus, hardware, seq_len, global_batch, layout)
RUNS = [
    # torchtitan Table 1 runs selective (op) AC; pinned here "always" (it recomputes more: a lower bound
    # on the selective run's speed), and "selective" in its own test below.
    (
        "torchtitan llama3.1-8b 8xH100 FSDP8",
        5762,
        "llama3-8b",
        8,
        TORCHTITAN_H100,
        8192,
        16,
        dict(pp=1, dp=8, tp=1, schedule="1f1b", microbatches=1, activation_checkpoint="always"),
    ),
    (
        "torchtitan llama3.1-70b 256xH100 FSDP32xTP8",
        597.3,
        "llama3-70b",
        256,
        TORCHTITAN_H100,
        8192,
        512,
        dict(pp=1, dp=32, tp=8, schedule="1f1b", microbatches=1, activation_checkpoint="always", compile=True),
    ),
    (
        "torchtitan llama3.1-8b 128xH100 FSDP128",
        5605,
        "llama3-8b",
        128,
        TORCHTITAN_H100,
        8192,
        256,
        dict(pp=1, dp=128, tp=1, schedule="1f1b", microbatches=1, activation_checkpoint="always"),
    ),
    # Megatron Table 1 does not print the microbatch size; 1,2 or 16 sequences make the same FLOPs.
    (
        "megatron gpt-1.7b 32xA100 DP32",
        9288,
        gpt_as_llama(2304, 24, 24),
        32,
        "a100-80gb",
        2048,
        512,
        dict(pp=1, dp=32, tp=1, schedule="1f1b", microbatches=16, activation_checkpoint="always", dp_mode="ddp"),
    ),
    (
        "megatron gpt-3.6b 64xA100 TP2xDP32",
        4431,
        gpt_as_llama(3072, 30, 32),
        64,
        "a100-80gb",
        2048,
        512,
        dict(pp=1, dp=32, tp=2, schedule="1f1b", microbatches=1, activation_checkpoint="always", dp_mode="ddp"),
    ),
    (
        "megatron gpt-7.5b 128xA100 TP4xDP32",
        2216,
        gpt_as_llama(4096, 36, 32),
        128,
        "a100-80gb",
        2048,
        512,
        dict(pp=1, dp=32, tp=4, schedule="1f1b", microbatches=1, activation_checkpoint="always", dp_mode="ddp"),
    ),
    (
        "megatron gpt-39.1b 512xA100 TP8xPP2xDP32",
        425,
        gpt_as_llama(8192, 48, 64),
        512,
        "a100-80gb",
        2048,
        1536,
        dict(
            pp=2,
            dp=32,
            tp=8,
            schedule="interleaved_1f1b",
            virtual_stages=2,
            microbatches=48,
            activation_checkpoint="always",
            dp_mode="ddp",
        ),
    ),
]


# Compared in docs/plan.md but outside the 20 % bound (the planner is pessimistic there: these A100
# FSDP runs reach 54-61 % of peak in model FLOPs, above constants.ACHIEVABLE_COMPUTE_FRACTION).
OUTSIDE_THE_BOUND = [
    (
        "torchtitan llama2-13b 64xA100 FSDP64",
        2162,
        llama2_13b(),
        64,
        "a100-80gb",
        4096,
        128,
        dict(pp=1, dp=64, tp=1, schedule="1f1b", microbatches=1, activation_checkpoint="never"),
    ),
    (
        "torchtitan llama3-8b 64xA100 FSDP64 (selective layer; always pinned)",
        2904,
        "llama3-8b",
        64,
        "a100-80gb",
        8192,
        64,
        dict(pp=1, dp=64, tp=1, schedule="1f1b", microbatches=1, activation_checkpoint="always"),
    ),
    (
        "torchtitan llama3-70b 64xA100 FSDP64",
        331,
        "llama3-70b",
        64,
        "a100-80gb",
        8192,
        64,
        dict(pp=1, dp=64, tp=1, schedule="1f1b", microbatches=1, activation_checkpoint="always"),
    ),
    # Llama 3 paper Table 4: AC, microbatches and V not published (assumed: none, 32, 2); 163 is
    # derived from 430 TFLOP/s at 6N + 12lhs FLOPs per token.
    (
        "llama3 405b 8192xH100 TP8xPP16xDP64",
        163,
        "llama3-405b",
        8192,
        "h100",
        8192,
        2048,
        dict(
            pp=16,
            dp=64,
            tp=8,
            schedule="interleaved_1f1b",
            virtual_stages=2,
            microbatches=32,
            activation_checkpoint="never",
        ),
    ),
]


@pytest.mark.parametrize(
    "name,published,model,gpus,hardware,seq_len,global_batch,layout", RUNS, ids=[r[0] for r in RUNS]
)
def test_tokens_per_second_within_20_percent(name, published, model, gpus, hardware, seq_len, global_batch, layout):
    plan = predict(model, gpus, hardware, seq_len, global_batch, **layout)
    error = plan.tokens_per_second_per_gpu / published - 1
    assert abs(error) <= 0.20, (
        f"{name}: predicted {plan.tokens_per_second_per_gpu:.1f}, published {published} ({error:+.1%})"
    )


def test_torchtitan_8b_speed_with_selective_checkpointing():
    plan = predict(
        "llama3-8b",
        8,
        TORCHTITAN_H100,
        8192,
        16,
        pp=1,
        dp=8,
        tp=1,
        schedule="1f1b",
        microbatches=1,
        activation_checkpoint="selective",
    )
    assert abs(plan.tokens_per_second_per_gpu / 5762 - 1) <= 0.20, plan.tokens_per_second_per_gpu


def test_torchtitan_8b_memory_with_selective_checkpointing():
    """82.4 GiB: torchtitan checkpoints each block, as mesh3d does with one backward per microbatch."""
    plan = predict(
        "llama3-8b",
        8,
        TORCHTITAN_H100,
        8192,
        16,
        pp=1,
        dp=8,
        tp=1,
        schedule="1f1b",
        microbatches=1,
        activation_checkpoint="selective",
    )
    assert abs(plan.memory_per_rank.total / GIB / 82.4 - 1) <= 0.20, plan.memory_per_rank


def test_interleaved_beats_1f1b_at_the_same_layout():
    """Megatron (S. 5.3.2, Fig. 12) and torchtitan (405B, Table 5) both publish interleaved 1F1B faster
    than 1F1B at the same layout; the planner's timeline must order them the same way."""
    model, layout = (
        gpt_as_llama(8192, 48, 64),
        dict(pp=2, dp=32, tp=8, microbatches=48, activation_checkpoint="always", dp_mode="ddp"),
    )
    plain = predict(model, 512, "a100-80gb", 2048, 1536, schedule="1f1b", **layout)
    interleaved = predict(
        model, 512, "a100-80gb", 2048, 1536, schedule="interleaved_1f1b", **{**layout, "virtual_stages": 2}
    )
    assert interleaved.tokens_per_second_per_gpu > plain.tokens_per_second_per_gpu
    assert interleaved.bubble_fraction < plain.bubble_fraction


# torchtitan Table 2 (benchmarks/llama3_h100_202412_torchtitan.md): Llama 3.1 8B on 8 H100s, FSDP x CP
# over the 8 GPUs, full AC, local batch 1, torch.compile and Float8: each rank holds 32k tokens at every
# length. mesh3d has no Float8 (bf16 is predicted, compile pinned). The four runs are modelled as mesh3d
# runs them, which is not how torchtitan does (docs/plan.md): its ring attention runs the causal flash
# kernel on each K/V chunk and keeps no mask, and its loss takes the whole logits in fp32; mesh3d
# gathers K/V for masked SDPA calls over row blocks of queries, runs them again in backward, keeps the
# boolean mask rows, and chunks its loss.
# (dp, cp, seq_len, published tokens/s/GPU, published GiB)
CONTEXT_PARALLEL_RUNS = [
    (8, 1, 32768, 3890, 83.9),
    (4, 2, 65536, 2540, 84.2),
    (2, 4, 131072, 1071, 84.0),
    (1, 8, 262144, 548, 84.5),
]
# Compared in docs/plan.md but outside the 20 % bound, optimistic: torchtitan's attention runs at a
# falling rate past 65k tokens (27.5 % MFU at 262k in its own count), and the planner charges mesh3d's
# at the one achievable rate, its row blocks of 2**21 / seq_len queries (16 and 8 here) included.
CONTEXT_PARALLEL_OUTSIDE_THE_BOUND = {131072, 262144}


def llama3_8b_long() -> transformers.LlamaConfig:
    """The preset, taking the 262k-token sequences torchtitan trained at (RoPE is not the planner's concern)."""
    from mesh3d.planner.model_source import preset_config

    config = preset_config("llama3-8b")
    config.max_position_embeddings = 262144
    return config


@pytest.fixture(scope="module")
def context_parallel_plans():
    """The four runs, one probe each at 32k tokens per rank (seconds: the attention on fake tensors)."""
    return {
        seq_len: predict(
            llama3_8b_long(),
            8,
            TORCHTITAN_H100,
            seq_len,
            dp,  # local batch 1: the cp ranks of a group share their rows
            pp=1,
            dp=dp,
            cp=cp,
            tp=1,
            schedule="1f1b",
            microbatches=1,
            activation_checkpoint="always",
            compile=True,
        )
        for dp, cp, seq_len, _, _ in CONTEXT_PARALLEL_RUNS
    }


WITHIN_THE_BOUND = [r for r in CONTEXT_PARALLEL_RUNS if r[2] not in CONTEXT_PARALLEL_OUTSIDE_THE_BOUND]


@pytest.mark.parametrize("dp,cp,seq_len,published,_", WITHIN_THE_BOUND, ids=[f"cp{r[1]}" for r in WITHIN_THE_BOUND])
def test_context_parallel_speed_within_20_percent(context_parallel_plans, dp, cp, seq_len, published, _):
    plan = context_parallel_plans[seq_len]
    assert (plan.dp, plan.cp) == (dp, cp)
    error = plan.tokens_per_second_per_gpu / published - 1
    assert abs(error) <= 0.20, f"cp={cp}: predicted {plan.tokens_per_second_per_gpu:.1f}, published {published}"


def test_context_parallel_memory_against_torchtitan(context_parallel_plans):
    """torchtitan's memory is flat (84 GiB) over the four: the same 32k tokens per rank, parameters
    sharded over the same 8. The planner's held and kept bytes are the same at every cp too; what
    grows is mesh3d's own: one layer's whole-sequence K/V and the mask rows of 32k queries over every
    key, which torchtitan's ring attention does not hold. So the prediction stays below the published
    peak (mesh3d's loss is chunked, torchtitan's takes the fp32 logits) and the gap closes with S."""
    plans = [context_parallel_plans[seq_len] for _, _, seq_len, _, _ in CONTEXT_PARALLEL_RUNS]
    kept = {(p.memory_per_rank.parameters, p.memory_per_rank.activations) for p in plans}
    assert len(kept) == 1
    whole = [p.memory_per_rank.context_parallel for p in plans]
    assert whole[0] == 0 and whole[1] < whole[2] < whole[3]
    for plan, (_, _, _, _, published) in zip(plans, CONTEXT_PARALLEL_RUNS):
        assert plan.memory_per_rank.total / GIB < published
