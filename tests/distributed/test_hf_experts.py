"""Mixture-of-experts and latent attention under tensor parallelism (issue 38), as transformers plans it:
each expert split along its intermediate features ("moe_tp_experts" with a "packed_colwise" gate_up,
a torch `_StridedShard`, and a "rowwise" down), the parts summed over tp; latent attention's shared
rotary key ("mla_kv_a_proj") with its gradient summed over tp.

One launch of 4 ranks, two tiny models given on meta and initialized by mesh3d (seeded, so every
layout holds the same weights): Qwen3-MoE (packed experts, per-head q/k norms) and DeepSeek-V3 (latent
attention with its split projection, a dense first block, routed and shared experts).

- Each is initialized alike at (2,1,2), at (1,2,2) (FSDP over tp: the expert weights split over
  dp by expert and over tp strided) and at (4,1,1) (whole experts), and two SGD steps at each equal
  transformers' own model trained from that initial state in one process (every loss and
  parameter, fp32, rel 1e-5).
- Qwen3-MoE saved at (2,1,2) after one step with its momentum (strided shards through the
  distributed checkpoint), loaded at (1,2,2) and at (4,1,1) (whole experts): each holds the saved
  weights exactly, and the (1,2,2) one's second step equals transformers' second step.
- Exported from (1,2,2): `from_pretrained` of it gives transformers' logits; imported at (2,1,2)
  (each rank reading the two windows of its strided shard) it holds the same weights.
- A directory transformers' `save_pretrained` wrote (the Hub's layout, experts one by one; Mixtral's
  under their old names, `block_sparse_moe.experts.0.w1`) imports at (2,1,2) into the fused,
  strided expert weights: every tensor equals the saved model's.
"""

from __future__ import annotations

import hf_cases
import numpy as np
import pytest
import torch
import zoo_cases
from multiprocess import run_on_ranks

transformers = pytest.importorskip("transformers")

BATCH, MICROBATCHES, SEED, MOMENTUM = 8, 4, 3, 0.9
# DeepSeek-V3 with experts from its second block on, one shared expert (hf_cases' latent attention sizes).
MODELS = {
    "qwen3_moe": {},
    "deepseek_v3": dict(first_k_dense_replace=1, n_shared_experts=1, moe_intermediate_size=16, n_group=1, topk_group=1),
}
LAYOUTS = ((2, 1, 2), (1, 2, 2), (4, 1, 1))
SAVED_BY_TRANSFORMERS = ("qwen3_moe", "mixtral")  # the last without tensor parallelism: whole experts


def _parallelize(arch, layout, seed=SEED):
    import mesh3d

    model = hf_cases.meta_hf_model(arch, **MODELS[arch])
    return mesh3d.parallelize(model, layout, schedule="1f1b", microbatches=MICROBATCHES, seed=seed)


def _on_rank(root: str) -> dict:
    import mesh3d

    data = hf_cases.masked_batches(BATCH)
    out: dict = {"runs": {}}
    for arch in MODELS:
        for pp, dp, tp in LAYOUTS:
            layout = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
            pm = _parallelize(arch, layout)
            initial = pm.full_state_dict()
            optimizer = torch.optim.SGD(pm.parameters(), lr=hf_cases.LR, momentum=MOMENTUM)
            out["runs"][(arch, (pp, dp, tp))] = (
                initial,
                hf_cases.optimizer_steps(pm, layout, optimizer, data),
                pm.full_state_dict(),
            )

    layout = mesh3d.build_mesh(pp=2, dp=1, tp=2)
    pm = _parallelize("qwen3_moe", layout)
    optimizer = torch.optim.SGD(pm.parameters(), lr=hf_cases.LR, momentum=MOMENTUM)
    hf_cases.optimizer_steps(pm, layout, optimizer, data[:1])
    saved = pm.full_state_dict()
    mesh3d.checkpoint.save(f"{root}/ckpt", pm, optimizer, step=1)
    out["loaded"] = {}
    for pp, dp, tp in ((1, 2, 2), (4, 1, 1)):
        layout = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
        pm = _parallelize("qwen3_moe", layout, seed=SEED + 1)  # other weights until loaded
        optimizer = torch.optim.SGD(pm.parameters(), lr=hf_cases.LR, momentum=MOMENTUM)
        mesh3d.checkpoint.load(f"{root}/ckpt", pm, optimizer)
        loaded = pm.full_state_dict()
        out["loaded"][(pp, dp, tp)] = all(torch.equal(loaded[k], saved[k]) for k in saved)
        if (pp, dp, tp) == (1, 2, 2):
            out["resumed"] = (hf_cases.optimizer_steps(pm, layout, optimizer, data[1:]), pm.full_state_dict())
            mesh3d.checkpoint.export_safetensors(pm, f"{root}/export")
            exported = pm.full_state_dict()
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=2)
    pm = _parallelize("qwen3_moe", layout, seed=SEED + 1)
    mesh3d.checkpoint.import_safetensors(pm, f"{root}/export")
    imported = pm.full_state_dict()
    out["imported"] = all(torch.equal(imported[k], exported[k]) for k in exported)

    out["saved by transformers"] = {}
    for arch in SAVED_BY_TRANSFORMERS:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(zoo_cases.tiny_config(arch))
        pm = mesh3d.parallelize(model, layout, schedule="1f1b", microbatches=MICROBATCHES, seed=SEED)
        mesh3d.checkpoint.import_safetensors(pm, f"{root}/saved_{arch}")
        out["saved by transformers"][arch] = pm.full_state_dict()
    return out if layout.rank == 0 else {}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("experts")
    for arch in SAVED_BY_TRANSFORMERS:  # the Hub's layout: experts one by one (Mixtral's renamed, w1/w3/w2)
        zoo_cases.tiny_model(arch).save_pretrained(root / f"saved_{arch}")
    return run_on_ranks(_on_rank, 4, str(root), timeout=600)[0], root


@pytest.mark.parametrize("arch", list(MODELS))
def test_initialized_alike_under_two_layouts_and_exact_against_transformers(arch, launched):
    out, _ = launched
    first, *others = (out["runs"][(arch, layout)][0] for layout in LAYOUTS)
    for other in others:
        assert sorted(first) == sorted(other)
        for name in first:
            assert torch.equal(first[name], other[name]), name
    data = hf_cases.masked_batches(BATCH)
    reference = hf_cases.reference_run(arch, data, state=first, momentum=MOMENTUM, **MODELS[arch])
    for layout in LAYOUTS:
        _, losses, state = out["runs"][(arch, layout)]
        error, where = hf_cases.worst_error((losses, state), reference)
        assert error <= hf_cases.TOLERANCE, (layout, where, error)


def test_a_checkpoint_of_strided_experts_loads_under_other_layouts_and_resumes_exactly(launched):
    out, _ = launched
    assert out["loaded"] == {(1, 2, 2): True, (4, 1, 1): True}
    initial = out["runs"][("qwen3_moe", (2, 1, 2))][0]
    ref_losses, ref_state = hf_cases.reference_run(
        "qwen3_moe", hf_cases.masked_batches(BATCH), state=initial, momentum=MOMENTUM
    )
    losses, state = out["resumed"]
    error, where = hf_cases.worst_error((losses, state), (ref_losses[1:], ref_state))
    assert error <= hf_cases.TOLERANCE, (where, error)


def test_the_export_is_transformers_model_and_imports_into_strided_shards(launched):
    out, root = launched
    assert out["imported"]
    _, state = out["resumed"]
    reference = hf_cases.hf_model("qwen3_moe")
    reference.load_state_dict({name: torch.as_tensor(np.asarray(value)) for name, value in state.items()})
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / "export")
    tokens = hf_cases.masked_batches(BATCH, seed=7)[0][0]
    with torch.no_grad():
        want, got = reference.eval()(tokens).logits, exported.eval()(tokens).logits
    assert ((got - want).norm() / want.norm()).item() <= hf_cases.TOLERANCE


@pytest.mark.parametrize("arch", SAVED_BY_TRANSFORMERS)
def test_experts_saved_one_by_one_import_into_strided_shards(arch, launched):
    out, _ = launched
    want = zoo_cases.tiny_model(arch).state_dict()
    got = out["saved by transformers"][arch]
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
