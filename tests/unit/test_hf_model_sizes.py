"""train.py --hf-model ARCH at --config's sizes: a mixture of experts shrinks with the rest.

Built on meta, as train.py builds it: at `--config debug` (1.54M parameters as the LLaMA example)
Qwen3-MoE, Mixtral, Qwen2-MoE and DeepSeek-V3 stay under 5M parameters (their own configs' 128,
8, 60 and 256 experts, Qwen3-MoE's experts of width 768 and DeepSeek's latent-attention ranks
would make hundreds of millions), with 8 experts, 2 per token; a dense architecture is as before.
Each then computes finite logits on CPU (the config's fields agree with each other). The shape
flags (--dim, --n-heads, --n-kv-heads, --n-experts) reach both models, and a bad one is refused
while the flags are parsed."""

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


def test_the_shape_flags_set_width_heads_and_experts():
    """--dim/--n-heads/--n-kv-heads change --config's shape (the example's and an architecture's);
    --n-experts an architecture's routed experts."""
    from examples.llama.arguments import parse_args
    from examples.llama.model_choice import model_config

    args = parse_args(
        ["--dim", "128", "--n-heads", "8", "--n-kv-heads", "2", "--hf-model", "qwen3_moe", "--n-experts", "4"]
    )
    sizes = model_config(args)
    assert (sizes.dim, sizes.n_heads, sizes.kv_heads) == (128, 8, 2)
    config = hf_config(args, sizes)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (128, 8, 2)
    assert config.num_experts == 4


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--dim", "100", "--n-heads", "8"], "dim=100 is not divisible by n_heads=8"),
        (["--n-heads", "8", "--n-kv-heads", "3"], "n_heads=8 is not divisible by n_kv_heads=3"),
        (["--n-experts", "4"], "--n-experts sets the experts of --hf-model ARCH"),
        (["--init-from-hf", "somewhere", "--dim", "64"], "drop --dim"),
    ],
)
def test_a_bad_shape_flag_is_refused_before_anything_starts(capsys, flags, said):
    from examples.llama.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(flags)
    assert said in capsys.readouterr().err


def test_n_experts_on_a_dense_architecture_is_refused():
    with pytest.raises(SystemExit, match="not a mixture of experts"):
        hf_config(argparse.Namespace(hf_model="qwen3", config="debug", n_experts=4), get_config("debug"))
