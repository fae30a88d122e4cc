"""train.py --hf-model with mixture-of-experts models (issue 38): Qwen3-MoE and DeepSeek-V3 (latent
attention, a dense first block, routed and shared experts), tiny, at (pp, dp, tp) = (2, 2, 1)
with the experts split over ep = 2 (`--ep 2`), on 4 ranks, from a directory holding only their
config (mesh3d initializes the weights, each rank its own experts):

- `--steps 8 --export-hf`: it trains (the loss on a repeating corpus falls), its logging steps'
  metrics rows carry every routed block's tokens per expert (each token's top-k, over every rank)
  and the worst block's max/mean load, which the progress line says; and the export is its
  own architecture to transformers: `from_pretrained` gives the logits of the model built from the
  config with the exported tensors loaded by name, strictly (every expert weight read, none
  initialized anew by transformers).
- the export given back as `--hf-model` at (pp, dp, tp) = (1, 2, 1), ep 2, `--steps 0 --export-hf`
  (two ranks: the experts split over ep is what this import adds): imported (each rank reading its
  own experts), gathered and written again, `from_pretrained` of it gives the first export's
  logits (1e-5): fused gate/up, down, router and shared experts each land in place. (An import
  split into pipeline stages: test_train_hf.py's Qwen2 at --pp 2, and test_hf_experts.py's
  Qwen3-MoE experts at (2, 1, 2).)

(A directory transformers 5 itself saves, experts one by one: test_hf_experts.py.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_cases import TOLERANCE, VOCAB, hf_config
from test_torchrun import _losses
from test_train_hf import _logits, _relative, _run

transformers = pytest.importorskip("transformers")

MOE = {
    # with the router's load-balancing loss on: the metrics carry it beside the cross-entropy
    "qwen3_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        head_dim=8,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    ),
    "deepseek_v3": dict(
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        n_group=1,
        topk_group=1,
    ),
}


def _loaded_by_name(directory: Path):
    """The architecture built from the export's config, its tensors loaded by name, strictly."""
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(file))
    model.load_state_dict(state, strict=not config.tie_word_embeddings)
    return model


@pytest.mark.parametrize("arch", list(MOE))
def test_a_moe_model_trains_at_pp2_dp2_and_exports_as_itself(arch, tmp_path):
    hf_config(arch, **MOE[arch]).save_pretrained(tmp_path / arch)  # the config alone: mesh3d initializes
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.tile(np.arange(3, 35, dtype=np.int64), 128))  # a repeating corpus: learnable
    layout = ["--pp", "2", "--dp", "2", "--ep", "2", "--token-file", str(tokens), "--seq-len", "8"]

    metrics = tmp_path / "m.jsonl"
    done = _run("--hf-model", str(tmp_path / arch), *layout, "--steps", "8", "--metrics", str(metrics),
                "--export-hf", str(tmp_path / "trained"), torchrun=4)  # fmt: skip
    losses = _losses(metrics)
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.1, losses
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    # the experts' loads, read on the logging steps alone (--log-every 4: steps 1, 5 and the last)
    logged = [row for row in rows if "expert_load" in row]
    assert [row["step"] for row in logged] == [1, 5, 8], [row["step"] for row in rows if "expert_load" in row]
    for row in logged:
        loads = row["expert_load"]
        # global batch 8 x seq 8 tokens, each routed to its top 2 of 4 experts, counted once over the ranks
        assert loads and all(len(load) == 4 and sum(load) == 8 * 8 * 2 for load in loads.values()), loads
        worst = max(loads.values(), key=max)
        assert row["expert_imbalance"] == pytest.approx(max(worst) / (sum(worst) / 4)), row
        assert max(loads[row["expert_imbalance_block"]]) == max(worst) and 1 <= row["expert_imbalance"] <= 4
    said = [float(x) for x in re.findall(r"  experts max/mean (\d+\.\d\d)", done.stdout)]
    assert said == [round(row["expert_imbalance"], 2) for row in logged], done.stdout[-3000:]
    if MOE[arch].get("output_router_logits"):
        assert all(row["router_aux"] > 0 and row["cross_entropy"] > 0 for row in rows)
        assert all(abs(row["cross_entropy"] + row["router_aux"] - row["loss"]) <= 1e-5 * row["loss"] for row in rows)
    else:
        assert not any("router_aux" in row for row in rows)
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trained")
    assert type(trained).__name__ == type(_loaded_by_name(tmp_path / "trained")).__name__
    assert trained.config.model_type == arch
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    want = _logits(_loaded_by_name(tmp_path / "trained"), ids)
    assert _relative(_logits(trained, ids), want) <= TOLERANCE

    reimport = ["--dp", "2", "--ep", "2", "--token-file", str(tokens), "--seq-len", "8"]
    _run("--hf-model", str(tmp_path / "trained"), *reimport, "--steps", "0",
         "--export-hf", str(tmp_path / "again"), torchrun=2)  # fmt: skip
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert type(again) is type(trained)
    assert _relative(_logits(again, ids), want) <= TOLERANCE
