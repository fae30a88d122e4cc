"""A trained LLaMA example model in one plain process, from what training leaves behind.

    source = TrainedSource.open("ckpt/step100")   # or "ckpt" (its newest checkpoint), or an --export-hf directory
    model = source.load(device="cpu")             # a plain Transformer with the trained weights

Two kinds of directory:

- a mesh3d checkpoint (`train.py --checkpoint-dir`), saved at any (pp, dp, tp): mesh3d's own
  `checkpoint.load` reads it into a one-process ParallelModel (pp = dp = tp = 1), which DCP
  reshards from the saving layout. The model's shape comes from the training arguments that
  train.py keeps in the checkpoint, its vocabulary, layer count and tying from the saved tensors.
- a Hugging Face directory (`train.py --export-hf`, or any LlamaForCausalLM checkpoint in
  safetensors): the shape from its config.json, the weights through `checkpoint.import_safetensors`.

Either way the whole model ends up as an ordinary module, so generation needs no process group.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

import mesh3d
from examples.llama.config import ModelArgs, get_config
from examples.llama.model import Transformer

_DCP_METADATA = ".metadata"
_TRAIN_STATE = "train_state.json"
_HF_CONFIG = "config.json"
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


@dataclass
class TrainedSource:
    """What a directory holds, read without loading any weight: enough to pick a tokenizer and size the model."""

    path: Path
    kind: str  # "checkpoint" or "huggingface"
    config: ModelArgs  # max_seq_len: the sequence length the model was trained on, where known
    tokenizer_path: Path | None  # the tokenizer.json it was trained with, when known (else: bytes)
    description: str
    eos_token: str | None = None  # the --eos-token the model was trained with, when it was given

    @classmethod
    def open(cls, path: str | os.PathLike) -> "TrainedSource":
        """A mesh3d checkpoint, a directory of them (its newest complete one), or a Hugging Face directory."""
        path = Path(path)
        if (path / _DCP_METADATA).is_file() and (path / _TRAIN_STATE).is_file():
            return _checkpoint_source(path)
        if (path / _HF_CONFIG).is_file() and any((path / name).is_file() for name in _HF_WEIGHTS):
            return _huggingface_source(path)
        if path.is_dir() and (newest := mesh3d.checkpoint.latest(path)) is not None:
            return _checkpoint_source(Path(newest))
        raise FileNotFoundError(
            f"{path} is neither a mesh3d checkpoint ({_DCP_METADATA} and {_TRAIN_STATE}), a directory of them, "
            f"nor a Hugging Face directory ({_HF_CONFIG} and {' or '.join(_HF_WEIGHTS)}); pass a directory that "
            "train.py wrote with --checkpoint-dir or --export-hf"
        )

    def load(self, device: torch.device | str = "cpu", max_seq_len: int | None = None) -> Transformer:
        """The whole model with the trained weights, in eval mode, on `device`.

        max_seq_len: the longest sequence it will see (prompt and new tokens); default the trained
        length. Rotary positions are computed for any length, but past the trained one the model
        meets positions it never saw.
        """
        if self.kind == "checkpoint":
            state = _state_through_mesh3d(self.config, lambda pm: mesh3d.checkpoint.load(self.path, pm))
        else:
            state = _state_through_mesh3d(self.config, lambda pm: mesh3d.checkpoint.import_safetensors(pm, self.path))
        config = self.config.with_(max_seq_len=max(self.config.max_seq_len, max_seq_len or 0))
        with torch.device("meta"):
            model = Transformer(config)
        model.to_empty(device=device)
        model.load_state_dict(state)
        return model.eval()


def _checkpoint_source(path: Path) -> TrainedSource:
    train_state = json.loads((path / _TRAIN_STATE).read_text())
    saved = (train_state.get("extra") or {}).get("args")
    if not isinstance(saved, dict):
        raise ValueError(
            f"{path} holds no training arguments (extra['args'], which examples/llama/train.py saves), so the "
            "model's shape is unknown; save with extra={'args': ...} as train.py does, or export the model "
            "with mesh3d.checkpoint.export_safetensors and load that directory"
        )
    if saved.get("hf_model"):
        raise ValueError(
            f"{path} holds a Hugging Face model (train.py --hf-model {saved['hf_model']}), which this loader, made for "
            "the LLaMA example's model, does not build; export it with train.py --export-hf (or --resume-from it with "
            "--steps at its step and --export-hf) and load the export with transformers"
        )
    if saved.get("init_from_hf"):
        base = ModelArgs.from_hf_config(
            json.loads(_required(Path(saved["init_from_hf"]) / _HF_CONFIG, path).read_text())
        )
    else:
        base = get_config(saved.get("config") or "debug")
    shapes = {
        name: tuple(entry.size)
        for name, entry in FileSystemReader(path).read_metadata().state_dict_metadata.items()
        if name.startswith("model.") and hasattr(entry, "size")
    }
    # The saved tensors decide what the arguments may not (a vocabulary taken from the tokenizer).
    layers = {name.split(".")[2] for name in shapes if name.startswith("model.layers.")}
    tied = any("output.weight" in names for names in train_state.get("tied") or [])
    # As train.py sizes the rotary table: the training length (or the Hugging Face model's, if longer).
    trained_len = saved.get("seq_len") or 1
    if saved.get("init_from_hf"):
        trained_len = max(trained_len, base.max_seq_len)
    config = base.with_(
        vocab_size=shapes["model.tok_embeddings.weight"][0],
        n_layers=len(layers),
        tie_embeddings=tied,
        max_seq_len=trained_len,
    )
    tokenizer = saved.get("tokenizer")
    if not tokenizer and saved.get("init_from_hf") and (Path(saved["init_from_hf"]) / "tokenizer.json").is_file():
        tokenizer = Path(saved["init_from_hf"]) / "tokenizer.json"
    layout = train_state.get("layout", {})
    where = f"pp={layout.get('pp')} dp={layout.get('dp')} tp={layout.get('tp')}"
    description = f"mesh3d checkpoint {path} (step {train_state.get('step')}, saved at {where})"
    return TrainedSource(
        path, "checkpoint", config, Path(tokenizer) if tokenizer else None, description, saved.get("eos_token")
    )


def _huggingface_source(path: Path) -> TrainedSource:
    config = ModelArgs.from_hf_config(json.loads((path / _HF_CONFIG).read_text()))
    tokenizer = path / "tokenizer.json"
    return TrainedSource(
        path, "huggingface", config, tokenizer if tokenizer.is_file() else None, f"Hugging Face directory {path}"
    )


def _required(file: Path, checkpoint: Path) -> Path:
    if not file.is_file():
        raise FileNotFoundError(
            f"{checkpoint} was trained from the Hugging Face model whose config is {file}, which is not there "
            "any more: the model's shape is read from it"
        )
    return file


def _state_through_mesh3d(config: ModelArgs, load: Callable[[mesh3d.ParallelModel], object]) -> dict[str, torch.Tensor]:
    """The whole model's state_dict (CPU), read by mesh3d into a one-process ParallelModel."""
    if dist.is_initialized() and dist.get_world_size() != 1:
        raise ValueError(
            f"loading a trained model for generation runs in one process, but this one is rank {dist.get_rank()} "
            f"of {dist.get_world_size()}; run it as a plain `python` command, not under torchrun"
        )
    started_here = not dist.is_initialized()
    try:
        layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device="cpu")
        with torch.device("meta"):
            model = Transformer(config)
        pm = mesh3d.parallelize(model, layout, schedule="gpipe", dp_mode="ddp")
        load(pm)
        return pm.full_state_dict()
    finally:
        if started_here and dist.is_initialized():
            dist.destroy_process_group()
