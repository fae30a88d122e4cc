"""Hugging Face causal LMs through mesh3d at every composition equal transformers' own model in one process.

One launch per layout (pp, dp, tp) = (2,1,1), (2,2,1) FSDP, (2,1,2) and (2,2,2); in each, all four
(at (2,2,2) Llama and Mistral, with Qwen3 given on meta) architectures of hf_cases (Llama: llama3
rope scaling, GQA, tied; Qwen2: biases, tied; Qwen3: q/k norms, head_dim not hidden/heads; Mistral:
untied), each under its own schedule, two steps with masked targets: every step's loss and every
parameter after the SGD steps equal hf_cases.reference_run (fp32, rel 1e-5), and the names of
pm.full_state_dict() are the model's own.
Riding along, cheaply: activation checkpointing (selective too: with FSDP, with TP, and compiled
under ZBV), compile="aot_eager", DDP, bf16 (close), evaluate, the bad-batch check, refusals on
every rank, and a model given on meta (initialized alike under two layouts, then trained exactly as
transformers trains those values).
"""

from __future__ import annotations

import functools

import hf_cases
import pytest
import torch
import zoo_cases
from multiprocess import run_on_ranks
from rank_errors import assert_raised_on_every_rank, messages_of

pytest.importorskip("transformers")

BATCH = 8
MICROBATCHES = 4
SEED = 7
RUNS = {  # layout -> {architecture: parallelize arguments}
    (2, 1, 1): {
        "llama": dict(schedule="1f1b"),
        "qwen2": dict(schedule="gpipe", activation_checkpoint="always"),
        "qwen3": dict(schedule="zero_bubble"),
        "mistral": dict(schedule="zbv", compile="aot_eager", activation_checkpoint="selective"),
    },
    (2, 2, 1): {
        "llama": dict(schedule="interleaved_1f1b", activation_checkpoint="selective"),
        "qwen2": dict(schedule="1f1b", dp_mode="ddp"),
        "qwen3": dict(schedule="gpipe"),
        "mistral": dict(schedule="zero_bubble"),
    },
    (2, 1, 2): {
        "llama": dict(schedule="1f1b", activation_checkpoint="selective"),
        "qwen2": dict(schedule="zbv"),
        "qwen3": dict(schedule="interleaved_1f1b"),
        "mistral": dict(schedule="gpipe"),
    },
    # 8 ranks cost two 4-rank launches: a tied and an untied model (Qwen3 comes given on meta, below);
    # each architecture's tp and dp are exact at the 4-rank layouts
    (2, 2, 2): {arch: dict(schedule="interleaved_1f1b") for arch in ("llama", "mistral")},
}
META_ARCH = {(2, 1, 2): "qwen3", (2, 2, 2): "qwen3"}  # a model given on meta, under two layouts


def _on_rank(pp: int, dp: int, tp: int) -> dict:
    import mesh3d

    layout = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
    data = hf_cases.masked_batches(BATCH)
    out = {"runs": {}}
    for arch, kwargs in RUNS[(pp, dp, tp)].items():
        out["runs"][arch] = hf_cases.pipeline_run(arch, layout, data, microbatches=MICROBATCHES, **kwargs)
    if (pp, dp, tp) == (2, 1, 1):
        out["evaluate"], out["bad batch"] = _evaluate_and_bad_batch(layout, data)
    if (pp, dp, tp) == (2, 2, 1):
        out["bf16"] = hf_cases.pipeline_run(
            "qwen2", layout, data, microbatches=MICROBATCHES, param_dtype=torch.bfloat16
        )
    if (pp, dp, tp) in META_ARCH:
        out["meta"] = _meta_run(META_ARCH[(pp, dp, tp)], layout, data)
    if tp > 1:
        out["refusals"] = messages_of(
            {
                **{
                    arch: functools.partial(mesh3d.parallelize, hf_cases.meta_hf_model(arch), layout)
                    for arch in ("granite", "gpt2")
                },
                # a style with no exact translation: "all_reduce" over split parameters
                "inkling_text": functools.partial(mesh3d.parallelize, zoo_cases.tiny_model("inkling_text"), layout),
            }
        )
    # Every rank's error messages; the results (the same on every rank) from rank 0 only.
    return out if layout.rank == 0 else {k: out[k] for k in ("refusals", "bad batch") if k in out}


def _evaluate_and_bad_batch(layout, data):
    import mesh3d

    pm = mesh3d.parallelize(hf_cases.hf_model("llama"), layout, schedule="1f1b", microbatches=MICROBATCHES)
    inputs, targets = data[0]
    evaluated = pm.evaluate(inputs, targets).item()
    bad = inputs.clone()
    bad[1, 2] = hf_cases.VOCAB
    return evaluated, messages_of({"id = vocab_size": lambda: pm.step(bad, targets)})


def _meta_run(arch, layout, data):
    """The initial full state of a meta model initialized by mesh3d, and its training run."""
    import mesh3d

    pm = mesh3d.parallelize(
        hf_cases.meta_hf_model(arch), layout, schedule="interleaved_1f1b", microbatches=MICROBATCHES, seed=SEED
    )
    initial = pm.full_state_dict()
    return initial, hf_cases.train_steps(pm, layout, data)


@functools.cache
def _launch(layout: tuple[int, int, int]) -> list[dict]:
    pp, dp, tp = layout
    return run_on_ranks(_on_rank, pp * dp * tp, pp, dp, tp, timeout=240)


@functools.cache
def _reference(arch: str):
    return hf_cases.reference_run(arch, hf_cases.masked_batches(BATCH))


@pytest.mark.parametrize("layout", list(RUNS), ids=lambda layout: "pp{}dp{}tp{}".format(*layout))
def test_every_architecture_equals_transformers(layout):
    results = _launch(layout)[0]
    for arch, run in results["runs"].items():
        assert sorted(run[1]) == sorted(hf_cases.hf_model(arch).state_dict()), arch
        error, where = hf_cases.worst_error(run, _reference(arch))
        assert error <= hf_cases.TOLERANCE, (layout, arch, RUNS[layout][arch], where, error)


def test_evaluate_and_the_bad_batch_check():
    ranks = _launch((2, 1, 1))
    assert abs(ranks[0]["evaluate"] - _reference("llama")[0][0]) <= hf_cases.TOLERANCE * _reference("llama")[0][0]
    expected = f"input token id {hf_cases.VOCAB} at position (1, 2) is outside [0, {hf_cases.VOCAB})"
    assert_raised_on_every_rank([rank["bad batch"] for rank in ranks], {"id = vocab_size": expected})


def test_bf16_is_close():
    losses, state = _launch((2, 2, 1))[0]["bf16"]
    ref_losses, ref_state = _reference("qwen2")
    assert all(abs(a - b) <= 2e-2 * b for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for name, want in ref_state.items():
        want = torch.from_numpy(want)
        assert ((state[name].float() - want).norm() / want.norm()).item() <= 1e-2, name


def test_a_meta_model_is_initialized_alike_under_two_layouts_and_trains_exactly():
    (first, run), (second, _) = _launch((2, 1, 2))[0]["meta"], _launch((2, 2, 2))[0]["meta"]
    assert sorted(first) == sorted(second) == sorted(hf_cases.hf_model("qwen3").state_dict())
    for name in first:
        assert torch.equal(first[name], second[name]), name
    config = hf_cases.hf_config("qwen3")
    assert torch.equal(first["model.norm.weight"], torch.ones(config.hidden_size))  # transformers' own init
    assert not first["model.embed_tokens.weight"][config.pad_token_id].any()
    assert abs(first["model.layers.0.mlp.up_proj.weight"].std().item() - config.initializer_range) < 0.002
    assert torch.equal(first["lm_head.weight"], first["model.embed_tokens.weight"])  # tied
    # From those values, transformers' model (rotary table computed by itself) trains to the same state.
    error, where = hf_cases.worst_error(
        run, hf_cases.reference_run("qwen3", hf_cases.masked_batches(BATCH), state=first)
    )
    assert error <= hf_cases.TOLERANCE, (where, error)


@pytest.mark.parametrize("layout", [(2, 1, 2), (2, 2, 2)], ids=["pp2dp1tp2", "pp2dp2tp2"])
def test_refused_on_every_rank(layout):
    assert_raised_on_every_rank(
        [rank["refusals"] for rank in _launch(layout)],
        {
            "granite": "GraniteForCausalLM",
            "inkling_text": "InklingForCausalLM (inkling_text): its tensor-parallel plan shards parameters of",
            "gpt2": "GPT2LMHeadModel",
        },
    )
