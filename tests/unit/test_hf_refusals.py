"""Hugging Face models mesh3d cannot take exactly are refused by name, in one process, before any collective
(anatomy_of and the tp-plan check are pure); and the plan it does translate is transformers' own."""

from __future__ import annotations

import hf_cases
import pytest
import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import _StridedShard

from mesh3d.model.hugging_face.tp_plan import declared_tp_plan, translate_tp_plan
from mesh3d.model.intake import anatomy_of
from mesh3d.model.traced.anatomy import traced_anatomy
from mesh3d.tensor.local_styles import ExpertsParallel, LatentKvProjection
from mesh3d.tensor.plan import TensorParallelConfig

pytest.importorskip("transformers")


def test_granite_with_an_embedding_multiplier_is_refused_by_name():
    with pytest.raises(ValueError, match="GraniteForCausalLM") as error:
        anatomy_of(hf_cases.meta_hf_model("granite"))
    assert "inputs_embeds" in str(error.value)


def test_granite_without_a_multiplier_is_taken():
    assert anatomy_of(hf_cases.meta_hf_model("granite", embedding_multiplier=1.0)).layers == "model.layers"


def test_gpt2_without_a_pipeline_plan_is_refused_with_why_it_cannot_be_traced():
    """GPT-2 declares no base_model_pp_plan; the refusal says why the traced path cannot take it
    either, and that reason is held against the traced path itself: its split falls inside
    `transformer` (were mesh3d ever to trace it, this test says to open the path)."""
    model = hf_cases.meta_hf_model("gpt2", use_cache=False)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*base_model_pp_plan") as error:
        anatomy_of(model, example_inputs=(tokens,))
    assert "its blocks (transformer.h) run inside 'transformer', which the causal LM's forward calls" in str(
        error.value
    )
    traced = traced_anatomy(model, (tokens,), ["transformer.h.1"])  # torch.export captures it whole
    with pytest.raises(ValueError, match="a split point falls inside module 'transformer'"):
        traced.traced.split(["transformer.h.1"])


def test_an_untranslatable_tp_style_is_refused_only_under_tensor_parallelism():
    # Inkling's shared experts: an "all_reduce" module over split parameters, no exact translation.
    import zoo_cases

    model = zoo_cases.tiny_model("inkling_text")
    anatomy = anatomy_of(model)  # pipeline-only use is fine
    assert TensorParallelConfig.resolve(model, 1, anatomy.tp_plan, False, refusal=anatomy.tp_plan_refusal).plan == {}
    with pytest.raises(ValueError) as error:
        TensorParallelConfig.resolve(
            model, 2, anatomy.tp_plan, False, anatomy.tensor_parallel_sizes, refusal=anatomy.tp_plan_refusal
        )
    message = str(error.value)
    assert message.startswith("InklingForCausalLM (inkling_text): ")
    assert "'model.layers.*.mlp.shared_experts'" in message and "'all_reduce'" in message, message


def test_experts_split_as_transformers_plans_them():
    plan = anatomy_of(hf_cases.meta_hf_model("qwen3_moe")).tp_plan
    experts = plan["model.layers.*.mlp.experts"]
    assert type(experts) is ExpertsParallel
    assert experts.placements == {"gate_up_proj": _StridedShard(1, split_factor=2), "down_proj": Shard(2)}
    assert not any(pattern.endswith(("gate_up_proj", "down_proj")) and "experts" in pattern for pattern in plan)
    latent = anatomy_of(hf_cases.meta_hf_model("minicpm3")).tp_plan["model.layers.*.self_attn.kv_a_proj_with_mqa"]
    assert type(latent) is LatentKvProjection and latent.rope_dim == hf_cases.hf_config("minicpm3").qk_rope_head_dim


def test_an_experts_parameter_the_plan_leaves_whole_is_refused():
    # Every tp rank would add all of it to its part of the output, and the parts are summed.
    model = hf_cases.meta_hf_model("qwen3_moe")
    experts = model.model.layers[1].mlp.experts
    experts.register_parameter("down_bias", torch.nn.Parameter(torch.zeros(4, 32, device="meta")))
    plan, refusal = translate_tp_plan(model)
    assert plan is None and "'model.layers.1.mlp.experts.down_bias'" in refusal and "whole" in refusal, refusal


def test_tp_must_divide_each_half_of_a_packed_expert_weight():
    # moe_intermediate_size 3: gate_up holds 2 x 3 rows, and tp = 2 would split each half unevenly.
    model = hf_cases.meta_hf_model("qwen3_moe", moe_intermediate_size=3)
    anatomy = anatomy_of(model)
    with pytest.raises(ValueError, match=r"tp=2 does not divide dim 1 \(size 3\) of 'model\.layers\.0\.mlp\.experts"):
        TensorParallelConfig.resolve(model, 2, anatomy.tp_plan, False, anatomy.tensor_parallel_sizes)


@pytest.mark.parametrize("arch", list(hf_cases.ARCHITECTURES))
def test_the_translated_plan_is_transformers_declaration(arch):
    model = hf_cases.meta_hf_model(arch)
    declared = declared_tp_plan(model)
    plan = anatomy_of(model).tp_plan
    assert set(plan) == set(declared)  # every declared module pattern, under its name in the whole model
    kinds = {
        "colwise": ColwiseParallel,
        "colwise_gather_output": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "embedding_rowwise": RowwiseParallel,
        "replicated_with_grad_allreduce": SequenceParallel,
    }
    for pattern, style in declared.items():
        assert type(plan[pattern]) is kinds[style], (pattern, style, plan[pattern])
    assert "model.layers.*.self_attn.q_proj" in plan and "lm_head" in plan and "model.embed_tokens" in plan


def test_tp_must_divide_the_heads_the_config_declares():
    model = hf_cases.meta_hf_model("llama")
    anatomy = anatomy_of(model)
    with pytest.raises(ValueError, match="tp=4 does not divide num_key_value_heads=2"):
        TensorParallelConfig.resolve(model, 4, anatomy.tp_plan, False, anatomy.tensor_parallel_sizes)


@pytest.mark.parametrize("arch", list(hf_cases.LATENT_ATTENTION))
def test_latent_attention_passes_the_exactness_probe(arch):
    # The probe shrinks the latent ranks and the rotary part of a head together (config.head_dim is it).
    assert anatomy_of(hf_cases.meta_hf_model(arch)).layers == "model.layers"


def test_a_configuration_transformers_cannot_run_is_refused_by_name():
    # Latent attention expands its keys to every query head: fewer kv heads than heads fails in transformers.
    with pytest.raises(ValueError, match=r"MiniCPM3ForCausalLM \(minicpm3\): a small instance .* fails to run"):
        anatomy_of(hf_cases.meta_hf_model("minicpm3", num_key_value_heads=2))


def test_a_per_head_parameter_the_plan_leaves_whole_is_refused_only_under_tensor_parallelism():
    # Doge's attention holds A (one value per kv head) while its plan splits the heads: at tp = 2 a
    # rank's 1 kv head would meet both values (transformers' own forward fails to broadcast there).
    import zoo_cases

    model = zoo_cases.tiny_model("doge")
    anatomy = anatomy_of(model)
    assert TensorParallelConfig.resolve(model, 1, anatomy.tp_plan, False, refusal=anatomy.tp_plan_refusal).plan == {}
    with pytest.raises(ValueError, match=r"DogeForCausalLM \(doge\).*'model\.layers\.0\.self_attn\.A'"):
        TensorParallelConfig.resolve(
            model, 2, anatomy.tp_plan, False, anatomy.tensor_parallel_sizes, refusal=anatomy.tp_plan_refusal
        )


@pytest.mark.parametrize("model_type", ["gpt_neox", "phi"])
def test_a_dropout_after_the_embedding_stands_down_on_later_stages(model_type):
    # Their base forward applies it to inputs_embeds: a later stage would find it deleted (None).
    import zoo_cases

    anatomy = anatomy_of(zoo_cases.tiny_model(model_type))
    assert anatomy.first[1] in anatomy.identity_when_dropped and anatomy.first[0] not in anatomy.identity_when_dropped


def test_a_router_auxiliary_loss_is_taken_where_the_stages_sums_give_it():
    # transformers adds coef x a load-balancing loss made of sums over every layer's router logits:
    # the stages hand the sums on (model/router_aux.py); test_router_loss.py checks the zoo.
    from mesh3d.model.router_aux import RouterAux

    anatomy = anatomy_of(hf_cases.meta_hf_model("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.02))
    assert anatomy.router_aux == RouterAux(0.02, 4, 2)
    assert anatomy_of(hf_cases.meta_hf_model("qwen3_moe")).router_aux is None  # off: the cross-entropy alone


@pytest.mark.parametrize(
    "arch, overrides, words",
    [
        ("llama", {}, None),
        ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "dynamic"),
        ("mistral", {"sliding_window": 4}, "sliding window of 4 tokens"),
    ],
)
def test_what_context_parallelism_refuses_is_read_from_the_config(arch, overrides, words):
    """At cp > 1 an architecture whose mask or rotary table depends on what a rank sees is refused
    by name (parallelize raises it before any message: tests/distributed/test_hf_context_parallel.py)."""
    from mesh3d.model.hugging_face.context_parallel import context_parallel_problem

    problem = context_parallel_problem(hf_cases.hf_config(arch, **overrides))
    assert (problem is None) if words is None else (words in problem), problem
