"""train.py --hf-model DIR_OR_ARCH: a Hugging Face causal LM, trained as transformers builds it.

- DIR, a directory with a config.json (from `save_pretrained`, the Hub, or `--export-hf`): the
  model is that config's; when the directory also holds weights (model.safetensors or the
  sharded index), training starts from them, each rank reading only its slices. The config's
  vocabulary stands: a tokenizer with more tokens is refused.
- ARCH, a transformers model type (`qwen2`, `llama`, `mistral`, `qwen3`...): that architecture at
  the sizes of `--config` (and --n-layers, --tied, --vocab-size), mapped onto the architecture's
  own config fields, a mixture of experts' and latent attention's scaled with them; the
  vocabulary follows the LLaMA example's rule (text_data.fit_vocab: the tokenizer's, padded to a
  multiple of lcm(64, tp)).

The model is built on the meta device and handed to mesh3d.parallelize as it is; its checkpoints
and `--export-hf` use its own names, and the export is a directory `from_pretrained` reads as the
same architecture.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from examples.llama.config import ModelArgs

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# The Hugging Face config fields that the LLaMA example's sizes set (ModelArgs.to_hf_config's names);
# an architecture takes those its config has.
SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "tie_word_embeddings",
)
# A mixture of experts at the sizes' scale: the architecture's own counts (Qwen3-MoE's 128 experts
# of width 768, DeepSeek-V3's 256) would leave a `--config debug` model at hundreds of millions of
# parameters. At most EXPERTS experts, EXPERTS_PER_TOKEN of them per token, each (and a shared
# expert) a quarter of the dense FFN's width, as Qwen3-MoE's are of its dense width.
EXPERTS, EXPERTS_PER_TOKEN = 8, 2
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
EXPERT_WIDTH_FIELDS = ("moe_intermediate_size", "shared_expert_intermediate_size")


def is_directory(spec: str) -> bool:
    """Whether --hf-model names a directory (else an architecture name)."""
    return Path(spec).is_dir()


def hf_model_dir(args: argparse.Namespace) -> str | None:
    """The --hf-model directory; None without --hf-model or when it names an architecture."""
    spec = getattr(args, "hf_model", None)
    return spec if spec and is_directory(spec) else None


def weights_dir(args: argparse.Namespace) -> str | None:
    """The --hf-model directory when it holds weights to start from; else None."""
    directory = hf_model_dir(args)
    return directory if directory and any((Path(directory) / name).is_file() for name in WEIGHT_FILES) else None


def check_spec(spec: str) -> str | None:
    """What is wrong with --hf-model's value, for the flag's error; None if it can be built."""
    try:
        import transformers
    except ImportError:
        return "--hf-model needs transformers: pip install 'mesh3d[hf]'"
    if is_directory(spec):
        if not (Path(spec) / CONFIG_FILE).is_file():
            return f"--hf-model {spec} is a directory without a {CONFIG_FILE}; pass a Hugging Face model directory"
        return None
    if spec not in transformers.CONFIG_MAPPING:
        return (
            f"--hf-model {spec!r} is neither a directory nor a transformers model type; pass a directory with a "
            f"{CONFIG_FILE} or a model type such as qwen2, llama, mistral, qwen3"
        )
    return None


def hf_config(args: argparse.Namespace, sizes: ModelArgs | None):
    """The transformers config to train: the directory's, or the architecture at `sizes` (the --config
    shape with its overrides and the fitted vocabulary)."""
    import transformers

    if is_directory(args.hf_model):
        return with_router_aux_loss(transformers.AutoConfig.from_pretrained(args.hf_model), args)
    default = transformers.AutoConfig.for_model(args.hf_model)
    llama = sizes.to_hf_config()
    fields = {name: llama[name] for name in SIZE_FIELDS if hasattr(default, name)}
    missing = [
        name for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if name not in fields
    ]
    if missing:
        raise SystemExit(
            f"--hf-model {args.hf_model}: its config ({type(default).__name__}) has no field "
            f"{', '.join(missing)} to take --config {args.config}'s sizes; pass a directory with a config.json"
        )
    if not _is_flat_rope(getattr(default, "rope_parameters", None)):
        fields.pop("rope_parameters", None)  # rotary settings per layer type: keep the architecture's own
    n_experts = getattr(args, "n_experts", None)
    experts = expert_sizes(default, fields["intermediate_size"], n_experts) if "intermediate_size" in fields else {}
    if n_experts is not None and not experts:
        raise SystemExit(f"--n-experts: --hf-model {args.hf_model} is not a mixture of experts; drop --n-experts")
    fields.update(experts)
    fields.update(latent_attention_sizes(default, sizes))
    return with_router_aux_loss(transformers.AutoConfig.for_model(args.hf_model, **fields), args)


def with_router_aux_loss(config, args: argparse.Namespace):
    """`config` with --router-aux-loss COEF applied (output_router_logits on, router_aux_loss_coef
    COEF: mesh3d then adds the router's load-balancing loss exactly, under any layout); as it is
    without the flag. Refused for a model without a router loss (no router_aux_loss_coef)."""
    coef = getattr(args, "router_aux_loss", None)
    if coef is None:
        return config
    if not hasattr(config, "router_aux_loss_coef"):
        raise SystemExit(
            f"--router-aux-loss: --hf-model {args.hf_model} ({type(config).__name__}) has no router "
            "load-balancing loss (no router_aux_loss_coef); drop --router-aux-loss"
        )
    config.output_router_logits, config.router_aux_loss_coef = True, coef
    return config


def latent_attention_sizes(default, sizes: ModelArgs) -> dict[str, int]:
    """Latent attention's ranks and head widths (DeepSeek-V2/V3's) at the scale of the sizes' width
    and heads, near DeepSeek-V3's proportions (q rank 1536 and kv rank 512 of 7168; heads of 128 +
    64 rotary); {} for other attention. Its keys and values have a head per query head."""
    if not hasattr(default, "kv_lora_rank"):
        return {}
    dim, head_dim = sizes.dim, sizes.dim // sizes.n_heads
    fields = {"kv_lora_rank": max(8, dim // 4), "qk_nope_head_dim": head_dim, "v_head_dim": head_dim}
    fields["num_key_value_heads"] = sizes.n_heads
    # the rotary part of each head (half the width of the rest, and even); the config's head_dim
    # names it (DeepSeek's rotary embedding reads head_dim), so it replaces the sizes' head_dim
    fields["qk_rope_head_dim"] = fields["head_dim"] = max(2, head_dim // 2 // 2 * 2)
    if getattr(default, "q_lora_rank", None):
        fields["q_lora_rank"] = max(8, dim // 2)
    return fields


def expert_sizes(default, dense_width: int, experts: int | None = None) -> dict[str, int]:
    """A mixture of experts' config fields at the scale of `dense_width`, `experts` routed experts
    (None: EXPERTS, or the architecture's count where smaller); {} for a dense architecture. An
    architecture with no width of its own for experts (Mixtral's) gives its experts
    `intermediate_size`, which then takes the experts' width."""
    aliases = getattr(type(default), "attribute_map", {})  # num_local_experts -> num_experts: set the field itself
    counts = [name for name in EXPERT_COUNT_FIELDS if name not in aliases and getattr(default, name, None)]
    if not counts:
        return {}
    experts = experts or min(EXPERTS, *(getattr(default, name) for name in counts))
    width = max(8, dense_width // 4 // 8 * 8)
    fields = dict.fromkeys(counts, experts)
    if hasattr(default, "num_experts_per_tok"):  # DeepSeek-V2's default leaves it None
        fields["num_experts_per_tok"] = min(EXPERTS_PER_TOKEN, default.num_experts_per_tok or EXPERTS, experts)
    widths = [name for name in EXPERT_WIDTH_FIELDS if getattr(default, name, None)]
    fields.update(dict.fromkeys(widths or ["intermediate_size"], width))
    if getattr(default, "n_group", None):  # DeepSeek's grouped routing: its groups must divide the experts
        fields["n_group"] = fields["topk_group"] = 1
    return fields


def _is_flat_rope(rope) -> bool:
    return isinstance(rope, dict) and "rope_type" in rope


def build(config) -> nn.Module:
    """The causal LM on the meta device: no memory until parallelize materializes this rank's part.

    Its parameters are fp32 whatever dtype the config was saved in (a Hub checkpoint's is often
    bfloat16): the optimizer updates fp32 master weights, --param-dtype sets the compute dtype.
    """
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def describe(config) -> str:
    return f"{type(config).__name__.removesuffix('Config')} (Hugging Face, {config.model_type})"
