"""Expert parallelism's checks, pure (expert_parallel/plan.py, axes.py): what ep a model and a layout
take, and the refusals, each naming what to change. The distributed test is test_expert_parallel.py."""

from __future__ import annotations

import hf_cases
import numpy as np
import pytest

from mesh3d.axes import describe
from mesh3d.axes import resolve_sizes as axis_sizes
from mesh3d.expert_parallel.plan import check_expert_parallel, translate_ep_plan

transformers = pytest.importorskip("transformers")


def test_ep_is_carved_from_the_ranks_of_a_stage():
    sizes = axis_sizes(8, pp=2, tp=2, ep=4)  # a stage's ranks: dp 2 x tp 2
    assert sizes == {"pp": 2, "dp": 2, "cp": 1, "tp": 2, "ep": 4}
    assert describe(sizes) == "pp=2, dp=2, tp=2, ep=4"
    assert axis_sizes(8, pp=2, tp=2)["ep"] == 1 and describe(axis_sizes(8, pp=2, tp=2)) == "pp=2, dp=2, tp=2"
    assert axis_sizes(8, pp=1, dp=2, cp=2, tp=2, ep=8)["ep"] == 8  # dp x cp x tp
    with pytest.raises(ValueError, match=r"ep=3 must divide .* dp\*cp\*tp=4 .* choose ep among \[1, 2, 4\]"):
        axis_sizes(8, pp=2, tp=2, ep=3)
    with pytest.raises(ValueError, match=r"ep=8 must divide"):
        axis_sizes(8, pp=2, tp=2, ep=8)  # the world, but not one stage's ranks
    with pytest.raises(ValueError, match="ep must be an int >= 1"):
        axis_sizes(8, pp=2, ep=0)
    assert axis_sizes(8, pp=2, tp=2, ep=np.int64(2))["ep"] == 2  # numpy integers, as for the other axes


def test_a_tp_plan_that_splits_the_sequence_is_refused_with_ep():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    from mesh3d.expert_parallel.apply import splits_the_sequence
    from mesh3d.tensor.plan import TensorParallelConfig

    assert not splits_the_sequence(TensorParallelConfig({"q_norm": SequenceParallel(sequence_dim=0)}))  # Qwen3's
    assert splits_the_sequence(TensorParallelConfig({"norm": SequenceParallel()}))
    assert splits_the_sequence(TensorParallelConfig({"o_proj": RowwiseParallel(output_layouts=Shard(1))}))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_experts_come_from_transformers_own_plan(arch):
    plan, refusal = translate_ep_plan(hf_cases.meta_hf_model(arch, num_experts=8, num_local_experts=8))
    assert refusal is None
    assert plan.patterns == ("model.layers.*.mlp.experts",) and plan.num_experts == 8
    assert plan.matches("model.layers.3.mlp.experts") and not plan.matches("model.layers.3.mlp.gate")
    check_expert_parallel(plan, None, 4, sequence_parallel=False)
    with pytest.raises(ValueError, match=r"ep=3 does not divide the 8 experts .* among \[1, 2, 4, 8\]"):
        check_expert_parallel(plan, None, 3, sequence_parallel=False)
    with pytest.raises(ValueError, match="sequence-parallel tp plan"):
        check_expert_parallel(plan, None, 2, sequence_parallel=True)


def test_a_model_without_an_ep_plan_is_refused_by_name_at_ep_above_one():
    plan, refusal = translate_ep_plan(hf_cases.meta_hf_model("llama"))
    assert plan is None and "LlamaForCausalLM (llama)" in refusal and "base_model_ep_plan is empty" in refusal
    check_expert_parallel(plan, refusal, 1, sequence_parallel=False)  # ep = 1: nothing to split, no error
    with pytest.raises(ValueError, match=r"LlamaForCausalLM \(llama\).*use ep=1"):
        check_expert_parallel(plan, refusal, 2, sequence_parallel=False)


def test_a_style_without_an_exact_translation_is_refused_by_name():
    model = hf_cases.meta_hf_model("qwen3_moe", num_experts=8)
    model.config.base_model_ep_plan = {**model.config.base_model_ep_plan, "layers.*.mlp.experts.norm": "colwise"}
    plan, refusal = translate_ep_plan(model)
    assert plan is None and "'model.layers.*.mlp.experts.norm' the style 'colwise'" in refusal


def test_an_experts_count_its_weights_do_not_share_is_refused():
    model = hf_cases.meta_hf_model("qwen3_moe", num_experts=8)
    model.model.layers[1].mlp.experts.num_experts = 4
    found, refusal = translate_ep_plan(model)
    assert found is None and "declares num_experts=4 but holds weights of [8] experts" in refusal


def test_an_experts_parameter_the_plan_does_not_split_is_refused():
    model = hf_cases.meta_hf_model("qwen3_moe", num_experts=8)
    plan = dict(model.config.base_model_ep_plan)
    del plan["layers.*.mlp.experts.down_proj"]
    model.config.base_model_ep_plan = plan
    found, refusal = translate_ep_plan(model)
    assert found is None and "holds 'down_proj', which the expert-parallel plan does not split" in refusal
