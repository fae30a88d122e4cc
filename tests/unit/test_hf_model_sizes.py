"""train.py --hf-model ARCH at --config's sizes: a mixture of experts shrinks with the rest.

Built on meta, as train.py builds it: at `--config debug` (1.54M parameters as the LLaMA example)
Qwen3-MoE, Mixtral, Qwen2-MoE and DeepSeek-V3 stay under 5M parameters (their own configs' 128,
8, 60 and 256 experts, Qwen3-MoE's experts of width 768 and DeepSeek's latent-attention ranks
would make hundreds of millions), with 8 experts, 2 per token; a dense architecture is as before.
Each then computes finite logits on CPU (the config's fields agree with each other)."""

import argparse

import pytest
import torch

from examples.llama.config import get_config
from examples.llama.hf_model import EXPERTS, EXPERTS_PER_TOKEN, build, hf_config

transformers = pytest.importorskip("transformers")


def _model(arch: str):
    config = hf_config(argparse.Namespace(hf_model=arch, config="debug"), get_config("debug"))
    return config, build(config)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3"])
def test_a_mixture_of_experts_at_debug_sizes_is_small_and_runs(arch):
    config, model = _model(arch)
    assert sum(p.numel() for p in model.parameters()) < 5e6
    counts = {getattr(config, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts")}
    assert counts - {None} == {EXPERTS} and config.num_experts_per_tok == EXPERTS_PER_TOKEN
    on_cpu = transformers.AutoModelForCausalLM.from_config(config)  # initialized, buffers included
    with torch.no_grad():
        logits = on_cpu(torch.randint(0, config.vocab_size, (2, 16))).logits
    assert logits.shape == (2, 16, config.vocab_size) and torch.isfinite(logits).all()


def test_a_dense_architecture_keeps_the_sizes():
    config, model = _model("qwen3")
    sizes = get_config("debug")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (
        sizes.dim,
        sizes.n_layers,
        sizes.n_heads,
    )
    assert not hasattr(config, "num_experts") and not hasattr(config, "num_local_experts")
