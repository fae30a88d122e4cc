"""Weights in and out as safetensors, in the layout transformers' LlamaForCausalLM reads and writes.

Export gathers one tensor at a time to global rank 0 through the state map (a DTensor is
assembled by the ranks of its owning pp rank, then sent from that pp rank's first rank), which writes `model.safetensors`
or, above `max_shard_size`, `model-0000k-of-0000n.safetensors` files with the standard
`model.safetensors.index.json`, plus `config.json`. Import needs no communication: every rank
opens the files and reads only the slices of the tensors it owns (safetensors reads a slice
without reading the rest of the file).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mesh3d.distributed.agree import attempt, raise_if_any
from mesh3d.checkpoint import hf_llama
from mesh3d.checkpoint.train_state import write_json
from mesh3d.parallel_model import ParallelModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3


def _model_config(pm: ParallelModel) -> dict | None:
    stage = next(iter(pm.stages.values()))
    return stage.hf_config() if callable(getattr(stage, "hf_config", None)) else None


def _as_dict(config: Any) -> dict:
    if isinstance(config, dict):
        return dict(config)
    for method in ("to_hf_config", "to_dict"):
        if callable(getattr(config, method, None)):
            return dict(getattr(config, method)())
    raise ValueError(
        f"config must be a dict (the contents of a Hugging Face config.json), a transformers config or an object "
        f"with to_hf_config(); got {type(config).__name__}"
    )


def _is_tied(pm: ParallelModel) -> bool:
    return any({hf_llama.EMBEDDING, hf_llama.OUTPUT} <= set(tie.names) for tie in pm.tied.ties)


def _shard_plan(sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
    """Names grouped into files in model order, each file at most max_shard_size bytes (or one tensor)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


@contextmanager
def _quiet_strided_gather():
    # Gathering an FSDP+TP (_StridedShard) tensor takes two all-gathers, and torch logs a warning
    # for every such tensor; the cost is known and paid once per tensor here.
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def export_safetensors(
    pm: ParallelModel,
    out_dir: str | os.PathLike,
    config: Any = None,
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
) -> str:
    """Write the whole model as safetensors with Hugging Face Llama names, plus config.json. Call on every rank.

    `transformers.LlamaForCausalLM.from_pretrained(out_dir)` loads the result. A tied output
    head is not written (transformers ties it to the embedding, as `save_pretrained` does).

    Args:
        config: the Hugging Face config (a dict, a transformers config, or an object with
            to_hf_config()); default: the model's own `hf_config()`.
        max_shard_size: bytes per file; a larger model is split into numbered files and an index.
        dtype: cast the weights on export (e.g. torch.bfloat16); default: as trained.

    Returns out_dir. Only global rank 0 writes; it holds one file's tensors at a time.
    """
    out_dir = Path(out_dir)
    layout = pm.layout
    config = _as_dict(config) if config is not None else _model_config(pm)
    if config is None:
        raise ValueError(
            "export_safetensors: pass config= (the Hugging Face config.json contents); this model has no hf_config()"
        )
    tied = _is_tied(pm)
    if bool(config.get("tie_word_embeddings", False)) != tied:
        raise ValueError(
            f"export_safetensors: config has tie_word_embeddings={config.get('tie_word_embeddings')} but the model's "
            f"embedding and output are {'tied' if tied else 'separate'}; give a config that matches the model"
        )
    specs = {n: spec for n, spec in pm.state.specs.items() if not (tied and n == hf_llama.OUTPUT)}
    hf_names = {name: hf_llama.to_hf(name) for name in specs}
    out_dtype = {n: dtype or spec[1] for n, spec in specs.items()}
    sizes = {n: spec[0].numel() * out_dtype[n].itemsize for n, spec in specs.items()}
    shards = _shard_plan(sizes, max_shard_size)
    files = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    config = {**config, "torch_dtype": str(next(iter(out_dtype.values()))).removeprefix("torch.")}
    config["dtype"] = config["torch_dtype"]

    error = attempt(lambda: _prepare_out_dir(out_dir)) if layout.rank == 0 else None
    raise_if_any(error)
    with _quiet_strided_gather():
        for file, names in zip(files, shards):
            tensors = {}
            for name, full in pm.state.gather(names, to=0):
                if full is not None:
                    tensors[hf_names[name]] = full.to(out_dtype[name]).contiguous()
            if layout.rank == 0:
                error = error or attempt(functools.partial(_write_file, out_dir / file, tensors))
    if layout.rank == 0 and not error:
        error = attempt(lambda: _write_index_and_config(out_dir, files, shards, hf_names, sizes, config))
    raise_if_any(error)
    return str(out_dir)


def _prepare_out_dir(out_dir: Path) -> None:
    """Create out_dir; remove the weights of an earlier export there, which a reader would mix in
    (a stale index naming files this export does not write, or a stale single file beside an index)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [*out_dir.glob("model*.safetensors"), *out_dir.glob("model*.safetensors.tmp"), out_dir / INDEX_FILE]:
        old.unlink(missing_ok=True)


def _write_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    temporary = path.with_name(path.name + ".tmp")
    save_file(tensors, str(temporary), metadata={"format": "pt"})
    os.replace(temporary, path)


def _write_index_and_config(out_dir, files, shards, hf_names, sizes, config) -> None:
    if len(files) > 1:
        weight_map = {hf_names[n]: file for file, names in zip(files, shards) for n in names}
        write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})
    write_json(out_dir / CONFIG_FILE, config)


def _weight_files(in_dir: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the file holding it."""
    index = in_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: in_dir / file for name, file in weight_map.items()}
    single = in_dir / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(
            f"import_safetensors: {in_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}; pass a directory written by "
            "save_pretrained(..., safe_serialization=True) or mesh3d.checkpoint.export_safetensors"
        )
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def import_safetensors(pm: ParallelModel, in_dir: str | os.PathLike) -> None:
    """Load Hugging Face Llama safetensors weights into the model, under any layout. Call on every rank.

    Each rank reads only the slices of the tensors it holds. The directory's config.json (if
    any) must agree with the model's `hf_config()` on every shape-deciding field; every tensor's
    shape is checked before any is read, and the first mismatch is named.
    """
    in_dir = Path(in_dir)
    files = _weight_files(in_dir)
    theirs = json.loads((in_dir / CONFIG_FILE).read_text()) if (in_dir / CONFIG_FILE).is_file() else None
    ours = _model_config(pm)
    if theirs is not None and ours is not None:
        mismatch = hf_llama.config_mismatch(ours, theirs)
        if mismatch:
            raise ValueError(f"import_safetensors: {in_dir} holds a different model: {mismatch}; build the model from its config")
    source = _source_names(pm, files, theirs, in_dir)
    shapes = _saved_shapes(files, set(source.values()))
    for name, (shape, _) in pm.state.specs.items():
        if shapes[source[name]] != tuple(shape):
            raise ValueError(
                f"import_safetensors: {source[name]} has shape {shapes[source[name]]} in {in_dir}, but this model's "
                f"{name} is {tuple(shape)}; build the model from the checkpoint's config"
            )
    raise_if_any(attempt(lambda: _read_local_slices(pm, files, source)))
    pm.tied.sync_values()


def _source_names(pm: ParallelModel, files: dict[str, Path], config: dict | None, in_dir: Path) -> dict[str, str]:
    """Model name -> the Hugging Face tensor it is read from.

    A checkpoint whose config ties the embeddings (or, without a config, that has no lm_head)
    uses the embedding as its output head, whatever else the files hold.
    """
    head, embedding = hf_llama.to_hf(hf_llama.OUTPUT), hf_llama.to_hf(hf_llama.EMBEDDING)
    theirs_tied = bool(config.get("tie_word_embeddings", False)) if config is not None else head not in files
    if _is_tied(pm) and not theirs_tied:
        raise ValueError(
            f"import_safetensors: {in_dir} has an output head of its own ({head}, untied embeddings) but this model "
            "ties its output to the embedding; build the model with untied embeddings"
        )
    source = {}
    for name in pm.state.specs:
        hf = hf_llama.to_hf(name)
        if name == hf_llama.OUTPUT and theirs_tied:
            hf = embedding
        if hf not in files:
            raise ValueError(f"import_safetensors: {in_dir} has no tensor {hf!r} (this model's {name})")
        source[name] = hf
    return source


def _saved_shapes(files: dict[str, Path], names: set[str]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, in_file in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in in_file:
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _read_local_slices(pm: ParallelModel, files: dict[str, Path], source: dict[str, str]) -> None:
    """Each rank reads only its own slices, opening each file it needs once."""
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}

        def read(name: str, window: tuple[slice, ...]) -> torch.Tensor:
            file = files[source[name]]
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            return opened[file].get_slice(source[name])[window]

        pm.state.load_by_slice(read)
