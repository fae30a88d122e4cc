"""save / load: a distributed checkpoint of model, optimizer and train state, loadable under any layout.

Tensors go through torch.distributed.checkpoint (DCP): every rank writes its own shards, keyed by
the unsplit model's names (flat_state.py), and DCP records where each shard sits in the global
tensor, so any other (pp, dp, tp, virtual stages, dp_mode) reads exactly the pieces it needs.
The train state is JSON (train_state.py). Every file gets a checksum (checksums.py), each rank
hashing the files it wrote; `load` verifies them first (integrity.py). The directory appears
under its name only once complete (directories.py). A save's steps are saving.py's, which
`async_save` (background_save.py) runs in a background thread instead; `save` and `load` first wait
for an async_save in flight.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from mesh3d.checkpoint.background_save import finish_previous
from mesh3d.checkpoint.flat_state import (
    apply_loaded,
    check_against_checkpoint,
    drop_state,
    flat_state,
    init_optimizer_state,
    targets,
    unsaved_optimizer_params,
)
from mesh3d.checkpoint.integrity import read_whole
from mesh3d.checkpoint.kept_versions import kept_targets, restore_kept, resume_problem
from mesh3d.checkpoint.saving import prepare, write_and_publish
from mesh3d.checkpoint.strided_entries import as_checkpointable, deliberate_sharded_tensors, take_replaced_values
from mesh3d.checkpoint.train_state import read_rng_state, set_rng_state
from mesh3d.distributed.agree import raise_if_any
from mesh3d.parallel_model import ParallelModel


def save(
    path: str | os.PathLike,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    data_state: Any = None,
    extra: Any = None,
    keep_last: int | None = None,
    writer_threads: int = 1,
    before_publish: Callable[[Path], None] | None = None,
    checksums: bool = True,
) -> str:
    """Save model, optimizer and train state to the directory `path`, atomically. Call on every rank.

    Training waits for the write; `async_save` takes the same arguments and writes in the background
    (an async_save in flight is waited for first, here and in `load`).

    Under a never-drain schedule it flushes first (`pm.flush()`), and saves the weight versions the
    update rule still names for the next calls (checkpoint/kept_versions.py): a resume continues
    with exactly the losses of an uninterrupted run (pipedream_2bw under any layout).

    Args:
        path: the checkpoint directory, e.g. "ckpt/step100". It appears only once complete; an
            existing checkpoint of that name is replaced (any other existing directory is refused).
        pm: the ParallelModel; every rank writes only its own shards.
        optimizer: saved keyed by parameter names (loadable under any other layout), or None.
        step: the training step, returned by `load` and used by `latest` to order checkpoints;
            default: the number `path`'s name ends with ("ckpt/step100" -> 100).
        data_state: the data loader's position (e.g. `DistributedLoader.state_dict()`), JSON;
            the same on every rank.
        extra: anything else JSON-serializable (an LR scheduler's state_dict, ...), rank 0's is saved.
        keep_last: afterwards keep `path` and the keep_last - 1 newest (by step) other checkpoints
            in `path`'s parent directory, removing the rest.
        writer_threads: files each rank writes in parallel (DCP's FileSystemWriter thread_count).
        before_publish: called on rank 0 once every shard and the train state are written, right
            before the checkpoint is published under its name, with the directory holding the
            files (its temporary name, renamed to `path` next): a job can check or copy them, a
            fault test can kill the process there. An exception it raises is raised on every
            rank and nothing is published.
        checksums: record a hash of every file (below); False leaves them out, and `load`
            then checks the files' sizes only (the cost of both: docs/performance.md).

    Every file written gets XXH3 hashes (one per 64 MiB block) in the checkpoint's checksums.json:
    each rank hashes the files it wrote, in threads, right after writing them, and `load`
    verifies them before reading.

    Returns the path. Raises ValueError on every rank for a bad argument (on any rank), for a
    parameter holding NaN or Inf (named) and for a failed preparation or publication; a shard
    write that failed with an OSError (ENOSPC: a full disk) raises that OSError on every rank,
    any other failed write DCP's CheckpointException. Either way nothing is published and the
    previous checkpoints are untouched.
    """
    finish_previous()  # one save at a time: an async_save in flight is published (or raised) first
    prepared = prepare(
        Path(path),
        pm,
        optimizer,
        step=step,
        data_state=data_state,
        extra=extra,
        keep_last=keep_last,
        writer_threads=writer_threads,
        before_publish=before_publish,
        checksums=checksums,
    )
    with deliberate_sharded_tensors():
        return write_and_publish(prepared, as_checkpointable(prepared.entries))


def load(
    path: str | os.PathLike,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict:
    """Load a checkpoint written by `save`, under this model's layout (any layout). Call on every rank.

    The model (and optimizer, if given) take the saved values; tied copies are made equal again;
    RNG states are restored (each rank its own when the layout is the saver's, else every rank
    rank 0's). Returns {"step", "data_state", "extra"} as saved; pass data_state to the loader's
    load_state_dict to resume at the exact next global sample, whatever the new dp degree.

    The optimizer must be of the class and state-shaping settings it was saved with (amsgrad,
    momentum); its hyperparameters (lr, betas, weight decay, ...) are taken from the checkpoint,
    while foreach/fused/capturable/differentiable stay as the given optimizer has them. A
    parameter the checkpoint holds no optimizer state for (saved before its first step) starts
    with none, as it would have in the saving run.

    Raises DamagedCheckpoint (a ValueError) on every rank, before reading any tensor, when a file of
    the checkpoint is missing, cut short, unreadable or changed since it was saved (its checksum,
    verified with the ranks sharing the files out), naming the checkpoint and the file.
    Raises ValueError on every rank, before reading any tensor, when the checkpoint does not fit
    the model (naming the first mismatching parameter) or the optimizer; the model and optimizer
    are then as they were.
    """
    finish_previous()  # an async_save in flight is published (or raised) before anything is read
    path = Path(path)
    layout = pm.layout
    pm.discard_in_flight()  # what the last calls left (late checks, a never-drain flight) is replaced
    train_state, metadata = read_whole(path)  # DamagedCheckpoint on every rank before any tensor is read
    created, state, error = [], None, None
    try:
        if optimizer is not None:
            created = init_optimizer_state(optimizer)
        state = flat_state(pm, optimizer)
        unsaved = unsaved_optimizer_params(state, metadata)
        if unsaved:  # saved before their first step: they start afresh, as they would have there
            drop_state(optimizer, unsaved)
            state = flat_state(pm, optimizer)
        error = check_against_checkpoint(
            pm,
            state,
            metadata,
            str(path),
            train_state.get("optimizer"),
            type(optimizer).__name__ if optimizer else None,
        ) or resume_problem(pm, train_state.get("never_drain"), metadata, str(path))
    except ValueError as problem:
        error = str(problem)
    try:
        raise_if_any(error)
    except ValueError:
        if optimizer is not None:
            drop_state(optimizer, created)  # a refused load leaves the optimizer as it was given
        raise

    to_load = targets(state, metadata)
    to_load.update(kept_targets(pm, train_state.get("never_drain")))
    checkpointable = as_checkpointable(to_load)  # strided shards as views: loaded in place
    with deliberate_sharded_tensors():
        dcp.load(
            checkpointable,
            storage_reader=FileSystemReader(path),
            planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
        )
    take_replaced_values(to_load, checkpointable)
    apply_loaded(state, to_load)
    pm.weights_replaced()
    restore_kept(pm, train_state.get("never_drain"), to_load)

    saved = train_state.get("layout", {})
    same_layout = all(saved.get(axis, 1) == size for axis, size in layout.sizes.items())  # cp: 1 where not saved
    rng = read_rng_state(path, layout.rank if same_layout else 0)
    if rng is not None:
        set_rng_state(rng, layout.device)
    return {"step": train_state["step"], "data_state": train_state.get("data_state"), "extra": train_state.get("extra")}
