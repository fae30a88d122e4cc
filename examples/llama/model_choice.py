"""Which model train.py trains: the LLaMA example's Transformer at --config's sizes (or a Hugging
Face Llama's, with --init-from-hf), or with --hf-model a Hugging Face model as transformers builds it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from examples.llama import hf_model
from examples.llama.config import ModelArgs, get_config
from examples.llama.model import Transformer
from examples.llama.text_data import check_fits, fit_vocab


def model_config(args) -> ModelArgs:
    """--config with its overrides, or the shape of the Hugging Face model given by --init-from-hf."""
    if args.init_from_hf:
        config = ModelArgs.from_hf_config(json.loads((Path(args.init_from_hf) / "config.json").read_text()))
        return config.with_(max_seq_len=max(config.max_seq_len, args.seq_len))
    overrides = {
        "max_seq_len": max(args.seq_len, 1),
        "n_layers": args.n_layers,
        "dim": args.dim,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "tie_embeddings": args.tied,
        "vocab_size": args.vocab_size,
    }
    return get_config(args.config, **{k: v for k, v in overrides.items() if v is not None})


def build_model(args, tokenizer) -> tuple[torch.nn.Module, str]:
    """The whole model on the meta device (no memory until parallelize materializes this rank's
    part), and how to name it: the LLaMA example's Transformer, or with --hf-model a Hugging Face
    model (a directory's config, or an architecture at --config's sizes)."""
    if args.hf_model and hf_model.is_directory(args.hf_model):
        config = hf_model.hf_config(args, None)
        check_fits(config.vocab_size, args.hf_model, tokenizer, args)
        _declare_eos(config, tokenizer, args)
        return hf_model.build(config), f"{args.hf_model}: {hf_model.describe(config)}"
    sizes = fit_vocab(model_config(args), tokenizer, args)  # the tokenizer's vocabulary unless --vocab-size
    if args.hf_model:
        config = hf_model.hf_config(args, sizes)
        _declare_eos(config, tokenizer, args)
        return hf_model.build(config), f"{hf_model.describe(config)} at --config {args.config}'s sizes"
    with torch.device("meta"):
        return Transformer(sizes), args.init_from_hf or args.config


def _declare_eos(config, tokenizer, args) -> None:
    """The transformers config's eos_token_id (what its export's config.json says, where generation
    stops): the token that ends each training document, where the config has none or --eos-token chose it."""
    if not args.token_file and (config.eos_token_id is None or args.eos_token is not None):
        config.eos_token_id = tokenizer.separator_id
