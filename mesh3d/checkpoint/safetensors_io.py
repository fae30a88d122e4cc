"""Weights in and out as safetensors, in the layout transformers' `from_pretrained` and `save_pretrained` use.

Names and config come from the model's adapter (`hf_adapter.py`): the Hugging Face name of each
state entry, the config written and checked, the tied embedding/output pair. The directory's files,
and the name each entry is written under: `hf_files.py`.

Export gathers one tensor at a time to global rank 0 through the state map (a DTensor is assembled
by the ranks of its owning pp rank, then sent from that pp rank's first rank), which writes
`model.safetensors` or, above `max_shard_size`, `model-0000k-of-0000n.safetensors` files with the
standard `model.safetensors.index.json`, plus `config.json`, and last `checksums.json`: a CRC-32 of
each weight file, as a checkpoint has (not of config.json and the index, which users edit by hand).
Import verifies those checksums when the file is there (each rank hashing a share of the files),
then every rank opens the files and reads only the slices of the tensors it owns (safetensors reads
a slice without reading the rest of the file).
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

from mesh3d.checkpoint.checksums import CHECKSUM_FILE, ManifestError, first_mismatch, read_manifest, share
from mesh3d.checkpoint.hf_adapter import HFAdapter, as_config_dict
from mesh3d.checkpoint.hf_files import (
    CONFIG_FILE,
    INDEX_FILE,
    adapter_for,
    is_tied,
    kept_names,
    saved_shapes,
    shard_files,
    shard_plan,
    weight_files,
    write_index_and_config,
)
from mesh3d.checkpoint.safetensors_stream import StreamedSafetensors
from mesh3d.checkpoint.transformers_sources import ExpertStack, checkpoint_source
from mesh3d.distributed.agree import attempt, raise_if_any
from mesh3d.parallel_model import ParallelModel

DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3


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
    """Write the whole model as safetensors with Hugging Face names, plus config.json. Call on every rank.

    The names and the config come from the model's `hf_adapter()` (docs/model_protocol.md); a
    model without one is written under its own names. For the LLaMA example,
    `transformers.LlamaForCausalLM.from_pretrained(out_dir)` loads the result. A tied weight is
    written once: a tied output head not at all (transformers ties it to the embedding, as
    `save_pretrained` does).

    Args:
        config: the Hugging Face config (a dict or a transformers config); default: the
            adapter's `hf_config()` (for a model without an adapter, its `config` attribute).
        max_shard_size: bytes per file; a larger model is split into numbered files and an index.
        dtype: cast the weights on export (e.g. torch.bfloat16); default: as trained.

    Returns out_dir. Only global rank 0 writes, one tensor at a time (it never holds a whole file).
    """
    out_dir = Path(out_dir)
    layout = pm.layout
    pm.flush()  # a never-drain schedule: every update in flight applied first
    adapter = adapter_for(pm)
    config = as_config_dict(config) if config is not None else adapter.hf_config()
    if config is None:
        raise ValueError(
            "export_safetensors: pass config= (the Hugging Face config.json contents); this model declares no "
            "hf_adapter() with an hf_config() and has no config attribute (docs/model_protocol.md)"
        )
    tied = is_tied(pm, adapter)
    if adapter.tied_pair is not None and bool(config.get("tie_word_embeddings", False)) != tied:
        raise ValueError(
            f"export_safetensors: config has tie_word_embeddings={config.get('tie_word_embeddings')} but the model's "
            f"embedding and output are {'tied' if tied else 'separate'}; give a config that matches the model"
        )
    kept = kept_names(pm, adapter)
    specs = {n: spec for n, spec in pm.state_map.specs.items() if kept[n] == n}
    hf_names = {name: adapter.to_hf(name) for name in specs}
    _refuse_shared_names(hf_names)
    out_dtype = {n: dtype or spec[1] for n, spec in specs.items()}
    sizes = {n: spec[0].numel() * out_dtype[n].itemsize for n, spec in specs.items()}
    shards = shard_plan(sizes, max_shard_size)
    files = shard_files(len(shards))
    config = {**config, "torch_dtype": str(next(iter(out_dtype.values()))).removeprefix("torch.")}
    config["dtype"] = config["torch_dtype"]

    error = attempt(lambda: _prepare_out_dir(out_dir)) if layout.rank == 0 else None
    raise_if_any(error)
    with _quiet_strided_gather():
        for file, names in zip(files, shards):
            error = _stream_file(pm, out_dir / file, names, hf_names, specs, out_dtype, error)
    if layout.rank == 0 and not error:
        error = attempt(lambda: write_index_and_config(out_dir, files, shards, hf_names, sizes, config))
    raise_if_any(error)
    return str(out_dir)


def _refuse_shared_names(hf_names: dict[str, str]) -> None:
    """An adapter that maps two state entries to one Hugging Face name would write one over the other."""
    seen: dict[str, str] = {}
    for name, hf in hf_names.items():
        if hf in seen:
            raise ValueError(
                f"export_safetensors: the model's hf_adapter() maps both {seen[hf]!r} and {name!r} to {hf!r}; "
                "each state entry needs its own Hugging Face name"
            )
        seen[hf] = name


def _prepare_out_dir(out_dir: Path) -> None:
    """Create out_dir; remove the weights of an earlier export there, which a reader would mix in
    (a stale index naming files this export does not write, or a stale single file beside an index)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = [*out_dir.glob("model*.safetensors"), *out_dir.glob("model*.safetensors.tmp"), out_dir / INDEX_FILE]
    for old in [out_dir / CHECKSUM_FILE, *stale]:
        old.unlink(missing_ok=True)


def _stream_file(pm: ParallelModel, path: Path, names, hf_names, specs, out_dtype, error: str | None) -> str | None:
    """One file, tensor by tensor: every rank joins each gather; global rank 0 writes each tensor as
    it arrives and drops it, so it never holds more than one (`safetensors_stream.py`). A failure
    on rank 0 is kept (every rank raises it after the export) while the gathers go on, so no rank
    waits alone."""
    opened: list[StreamedSafetensors] = []  # what attempt() opened (it returns only the error)
    if pm.layout.rank == 0 and error is None:
        entries = {hf_names[n]: (specs[n][0], out_dtype[n]) for n in names}
        error = attempt(lambda: opened.append(StreamedSafetensors(path, entries, {"format": "pt"})))
    writer = opened[0] if opened else None
    for name, full in pm.state_map.gather(names, to=0):
        if writer is not None and error is None:
            error = attempt(functools.partial(writer.write, hf_names[name], full.to(out_dtype[name])))
        del full
    if writer is not None:
        error = error or attempt(writer.close)
        if error is not None:
            writer.abandon()
    return error


def import_safetensors(pm: ParallelModel, in_dir: str | os.PathLike) -> None:
    """Load Hugging Face safetensors weights into the model, under any layout. Call on every rank.

    Each state entry is read from the tensor the model's `hf_adapter()` names (its own name
    without an adapter), and each rank reads only the slices it holds. Before any is read: the
    directory's config.json (if any) must agree with the model (the adapter's
    `config_mismatch`), the directory must hold a tensor for every state entry and place every
    tensor it holds (one the model has no entry for is refused, not dropped), and every tensor's
    shape must be the model's; the first mismatch is named. A directory written by
    `export_safetensors` carries checksums.json: its weight files are verified first (a file
    changed since the export raises ValueError on every rank, naming it); one without it (saved by
    transformers) loads unchecked.
    """
    in_dir = Path(in_dir)
    raise_if_any(_checksum_problem(in_dir, pm.layout.rank, pm.layout.world_size))
    adapter = adapter_for(pm)
    files = weight_files(in_dir)
    theirs = json.loads((in_dir / CONFIG_FILE).read_text()) if (in_dir / CONFIG_FILE).is_file() else None
    mismatch = adapter.config_mismatch(theirs) if theirs is not None else None
    if mismatch:
        raise ValueError(
            f"import_safetensors: {in_dir} holds a different model: {mismatch}; build the model from its config"
        )
    source, theirs_head = _source_names(pm, adapter, files, theirs, in_dir)
    read_names = {n for s in source.values() for n in (s.names() if isinstance(s, ExpertStack) else [s])}
    _refuse_unplaced(files, {*read_names, *theirs_head}, adapter, in_dir)
    shapes = saved_shapes(files, read_names)
    for name, (shape, _) in pm.state_map.specs.items():
        hf, saved = source[name], shapes.get(source[name])
        if isinstance(hf, ExpertStack):
            hf, saved = f"{hf.parts[0][0]} with its {hf.count()} experts stored one by one", hf.fused_shape(shapes)
        if saved != tuple(shape):
            raise ValueError(
                f"import_safetensors: {hf} has shape {saved or '(experts of differing shapes)'} in {in_dir}, but this "
                f"model's {name} is {tuple(shape)}; build the model from the checkpoint's config"
            )
    pm.discard_in_flight()
    raise_if_any(attempt(lambda: _read_local_slices(pm, files, source)))
    pm.weights_replaced()  # tied copies equal again; a never-drain schedule's rule starts afresh


def _checksum_problem(in_dir: Path, rank: int, world_size: int) -> str | None:
    """This rank's share of the checksum check of an export directory (none when it has no checksums.json)."""
    try:
        sums = read_manifest(in_dir)
    except ManifestError as damage:
        return f"import_safetensors: {in_dir} is damaged: {damage}"
    if sums is None:
        return None
    mismatch = first_mismatch(in_dir, sums, share(sums, rank, world_size))
    return f"import_safetensors: {in_dir} is damaged: {mismatch}; export it again" if mismatch else None


def _source_names(
    pm: ParallelModel, adapter: HFAdapter, files: dict[str, Path], config: dict | None, in_dir: Path
) -> tuple[dict[str, str | ExpertStack], set[str]]:
    """Model name -> the Hugging Face tensor it is read from (or the experts it stacks, where the
    checkpoint holds them one by one: transformers_sources.py); and the checkpoint's own output head
    when the checkpoint is tied (a copy of the embedding: read by nothing, yet no stray tensor).

    A checkpoint whose config ties the embeddings (or, without a config, that has no tensor for
    the adapter's output head) uses the embedding as its output head, whatever else the files hold.
    """
    kept = kept_names(pm, adapter)
    pair = adapter.tied_pair
    theirs_tied, head, embedding = False, None, None
    if pair is not None:
        embedding, head = adapter.to_hf(pair[0]), adapter.to_hf(pair[1])
        theirs_tied = bool(config.get("tie_word_embeddings", False)) if config is not None else head not in files
        if is_tied(pm, adapter) and not theirs_tied:
            raise ValueError(
                f"import_safetensors: {in_dir} has an output head of its own ({head}, untied embeddings) but this "
                "model ties its output to the embedding; build the model with untied embeddings"
            )
    source = {}
    model_type = getattr(getattr(adapter, "config", None), "model_type", None)
    for name, (shape, _) in pm.state_map.specs.items():
        hf = embedding if theirs_tied and name == pair[1] else adapter.to_hf(kept[name])
        if hf not in files and model_type is not None:  # renamed by transformers, or experts one by one?
            rows = lambda n: saved_shapes(files, {n})[n][0]  # noqa: E731 - read only for the names it finds
            hf = checkpoint_source(hf, model_type, set(files), tuple(shape), rows) or hf
        if not isinstance(hf, ExpertStack) and hf not in files:
            raise ValueError(f"import_safetensors: {in_dir} has no tensor {hf!r} (this model's {name})")
        source[name] = hf
    return source, {head} if theirs_tied else set()


def _refuse_unplaced(files: dict[str, Path], placed: set[str], adapter: HFAdapter, in_dir: Path) -> None:
    """A checkpoint tensor no state entry reads would be dropped silently (a model without the
    checkpoint's biases would compute something else); refuse, naming them."""
    unplaced = [n for n in files if n not in placed and not adapter.ignores(n)]
    if unplaced:
        shown = ", ".join(repr(n) for n in unplaced[:5]) + (" ..." if len(unplaced) > 5 else "")
        raise ValueError(
            f"import_safetensors: {in_dir} holds {len(unplaced)} tensor(s) this model has no place for ({shown}); "
            "loading without them would compute something else. Build a model that has them; a model that "
            "deliberately goes without them lists them in its hf_adapter()'s ignored_hf"
        )


def _read_local_slices(pm: ParallelModel, files: dict[str, Path], source: dict[str, str | ExpertStack]) -> None:
    """Each rank reads only its own slices, opening each file it needs once."""
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}

        def read_tensor(hf: str, window: tuple[slice, ...]) -> torch.Tensor:
            file = files[hf]
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            return opened[file].get_slice(hf)[window]

        def read(name: str, window: tuple[slice, ...]) -> torch.Tensor:
            hf = source[name]
            return hf.read(read_tensor, window) if isinstance(hf, ExpertStack) else read_tensor(hf, window)

        pm.state_map.load_by_slice(read)
