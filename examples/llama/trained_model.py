"""A trained LLaMA example model in one plain process, from what training leaves behind.

    source = TrainedSource.open("ckpt/step100")   # or "ckpt" (its newest checkpoint), or an --export-hf directory
    model = source.load(device="cpu")             # a plain Transformer with the trained weights

Three kinds of directory:

- a mesh3d checkpoint (`train.py --checkpoint-dir`), saved at any (pp, dp, tp): mesh3d's own
  `checkpoint.load` reads it into a one-process ParallelModel (pp = dp = tp = 1), which DCP
  reshards from the saving layout. The model's shape comes from the training arguments that
  train.py keeps in the checkpoint, its vocabulary, layer count and tying from the saved tensors.
- a Hugging Face Llama directory (`train.py --export-hf`, or any LlamaForCausalLM checkpoint in
  safetensors that the example's model implements): the shape from its config.json, the weights
  through `checkpoint.import_safetensors`.
- any other Hugging Face directory (`train.py --hf-model ... --export-hf`: Qwen2, Mistral, ...):
  transformers' own `AutoModelForCausalLM.from_pretrained` builds it (needs transformers).

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
    kind: str  # "checkpoint", "huggingface" (the example's Llama) or "transformers" (built by transformers)
    config: ModelArgs | None  # max_seq_len: the trained sequence length, where known; None for "transformers"
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

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (embedding rows)."""
        return self.config.vocab_size if self.config else self._hf_config()["vocab_size"]

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the model is known to have been trained (or configured) for."""
        return self.config.max_seq_len if self.config else self._hf_config().get("max_position_embeddings") or 0

    def _hf_config(self) -> dict:
        return json.loads((self.path / _HF_CONFIG).read_text())

    def load(self, device: torch.device | str = "cpu", max_seq_len: int | None = None) -> torch.nn.Module:
        """The whole model with the trained weights, in eval mode, on `device`.

        max_seq_len: the longest sequence it will see (prompt and new tokens); default the trained
        length. Rotary positions are computed for any length, but past the trained one the model
        meets positions it never saw. A "transformers" directory gives transformers' model.
        """
        if self.kind == "transformers":
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
            return model.to(device).eval()
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
        step = train_state.get("step")
        raise ValueError(
            f"{path} is a checkpoint of train.py --hf-model {saved['hf_model']}; generate.py reads such a model from "
            f"its Hugging Face export. Export it (this trains nothing): train.py with the run's flags and "
            f"--resume-from {path} --steps {step} --export-hf DIR, then pass --checkpoint DIR"
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
    where = f"pp={layout.get('pp')} dp={layout.get('dp')}" + (f" cp={layout['cp']}" if layout.get("cp", 1) != 1 else "")
    where += f" tp={layout.get('tp')}"
    description = f"mesh3d checkpoint {path} (step {train_state.get('step')}, saved at {where})"
    return TrainedSource(
        path, "checkpoint", config, Path(tokenizer) if tokenizer else None, description, saved.get("eos_token")
    )


def _huggingface_source(path: Path) -> TrainedSource:
    """The example's own model for a Llama it implements; transformers' for any other architecture."""
    hf_config = json.loads((path / _HF_CONFIG).read_text())
    tokenizer = path / "tokenizer.json"
    tokenizer = tokenizer if tokenizer.is_file() else None
    try:
        config = ModelArgs.from_hf_config(hf_config) if hf_config.get("model_type", "llama") == "llama" else None
    except ValueError:  # a Llama variant the example's model does not implement (biases, another rope)
        config = None
    if config is not None:
        return TrainedSource(path, "huggingface", config, tokenizer, f"Hugging Face directory {path}")
    try:
        import transformers  # noqa: F401 - only to say clearly what is missing
    except ImportError:
        raise ValueError(
            f"{path} holds a {hf_config.get('model_type')} model, which transformers builds: pip install 'mesh3d[hf]'"
        ) from None
    described = f"Hugging Face directory {path} ({hf_config.get('model_type')}, built by transformers)"
    return TrainedSource(path, "transformers", None, tokenizer, described)


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
