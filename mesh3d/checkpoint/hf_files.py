"""A Hugging Face weights directory as transformers lays it out, for export_safetensors and
import_safetensors (safetensors_io.py): its file names, which tensors go into which file, the index
and config written beside them, which file holds each tensor, and the name each state entry is
written under (a tied weight once).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from mesh3d.checkpoint.adapter_choice import adapter_of
from mesh3d.checkpoint.checksums import sums_of, write_manifest
from mesh3d.checkpoint.hf_adapter import HFAdapter
from mesh3d.checkpoint.train_state import write_json
from mesh3d.parallel_model import ParallelModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


def adapter_for(pm: ParallelModel) -> HFAdapter:
    """The adapter the model's state goes through (adapter_choice.py)."""
    return adapter_of(next(iter(pm.stages.values())), pm.state_map.ties)


def is_tied(pm: ParallelModel, adapter: HFAdapter) -> bool:
    """Whether the model ties the adapter's embedding/output pair."""
    pair = adapter.tied_pair
    return pair is not None and any(set(pair) <= set(names) for names in pm.state_map.ties)


def kept_names(pm: ParallelModel, adapter: HFAdapter) -> dict[str, str]:
    """Every state name -> the name its tensor is written under: a tied weight once, under the
    embedding of the adapter's tied pair (as save_pretrained does), else under its first name."""
    kept = {}
    for names in pm.state_map.ties:
        pair = adapter.tied_pair
        keep = pair[0] if pair is not None and set(pair) <= set(names) else names[0]
        kept.update(dict.fromkeys(names, keep))
    return {name: kept.get(name, name) for name in pm.state_map.specs}


def shard_plan(sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
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


def shard_files(count: int) -> list[str]:
    """The weight files of `count` shards: model.safetensors alone, or numbered files."""
    return [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index_and_config(out_dir, files, shards, hf_names, sizes, config) -> None:
    """The index (above one file), config.json, and last the weight files' checksums."""
    if len(files) > 1:
        weight_map = {hf_names[n]: file for file, names in zip(files, shards) for n in names}
        write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})
    write_json(out_dir / CONFIG_FILE, config)
    write_manifest(out_dir, sums_of(out_dir, files))


def weight_files(in_dir: Path) -> dict[str, Path]:
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


def saved_shapes(files: dict[str, Path], names: set[str]) -> dict[str, tuple[int, ...]]:
    """The shape of each named tensor as the files hold it, each file opened once."""
    shapes = {}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, in_file in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in in_file:
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes
