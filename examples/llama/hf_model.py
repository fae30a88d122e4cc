"""train.py --hf-model DIR_OR_ARCH: a Hugging Face causal LM, trained as transformers builds it.

- DIR, a directory with a config.json (from `save_pretrained`, the Hub, or `--export-hf`): the
  model is that config's; when the directory also holds weights (model.safetensors or the
  sharded index), training starts from them, each rank reading only its slices. The config's
  vocabulary stands: a tokenizer with more tokens is refused.
- ARCH, a transformers model type (`qwen2`, `llama`, `mistral`, `qwen3`...): that architecture at
  the sizes of `--config` (and --n-layers, --tied, --vocab-size), mapped onto the architecture's
  own config fields; the vocabulary follows the LLaMA example's rule (text_data.fit_vocab: the
  tokenizer's, padded to a multiple of lcm(64, tp)).

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
        return transformers.AutoConfig.from_pretrained(args.hf_model)
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
    return transformers.AutoConfig.for_model(args.hf_model, **fields)


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
