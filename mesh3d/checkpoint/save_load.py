"""save / load: a distributed checkpoint of model, optimizer and train state, loadable under any layout.

Tensors go through torch.distributed.checkpoint (DCP): every rank writes its own shards, keyed by
the unsplit model's names (flat_state.py), and DCP records where each shard sits in the global
tensor, so any other (pp, dp, tp, virtual stages, dp_mode) reads exactly the pieces it needs.
The train state is JSON (train_state.py). Every file gets a checksum (checksums.py), each rank
hashing the files it wrote; `load` verifies them first (integrity.py). The directory appears
under its name only once complete (directories.py).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from mesh3d.checkpoint import directories
from mesh3d.checkpoint.checksums import sums_of, write_manifest
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
from mesh3d.checkpoint.kept_versions import kept_entries, kept_targets, restore_kept, resume_problem, rule_state
from mesh3d.checkpoint.strided_entries import as_checkpointable, deliberate_sharded_tensors, take_replaced_values
from mesh3d.checkpoint.train_state import (
    FORMAT,
    RNG_DIR,
    TRAIN_STATE_FILE,
    VERSION,
    check_json,
    read_rng_state,
    rng_file,
    rng_state,
    set_rng_state,
    write_json,
)
from mesh3d.distributed.agree import attempt, gather_or_raise, raise_if_any
from mesh3d.mesh import Layout
from mesh3d.parallel_model import ParallelModel
from mesh3d.step.finite import first_non_finite


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
        checksums: record a CRC-32 of every file (below); False leaves them out, and `load`
            then checks the files' sizes only (the cost of both: docs/performance.md).

    Every file written gets CRC-32s (one per 64 MiB block) in the checkpoint's checksums.json:
    each rank hashes the files it wrote, in threads, right after writing them, and `load`
    verifies them before reading.

    Returns the path. Raises ValueError on every rank for a bad argument (on any rank), for a
    parameter holding NaN or Inf (named) and for a failed preparation or publication; a shard
    write that failed with an OSError (ENOSPC: a full disk) raises that OSError on every rank,
    any other failed write DCP's CheckpointException. Either way nothing is published and the
    previous checkpoints are untouched.
    """
    path = Path(path)
    layout = pm.layout
    pm.flush()  # a never-drain schedule: every update in flight applied (it changes no update rule)
    # Every check first, on every rank; one all-gather then shows each rank what all found, so a
    # problem on any rank is raised on all of them before anything is written.
    state = data_json = error = None
    try:
        step = _resolve_step(path, step)
        _check_count("keep_last", keep_last, allow_none=True)
        _check_count("writer_threads", writer_threads)
        data_json = check_json(data_state, "data_state")
        if layout.rank == 0:
            check_json(extra, "extra")  # rank 0's is the one saved
        state = flat_state(pm, optimizer)
        state.entries.update(kept_entries(pm))
        _check_finite(pm, layout)
    except ValueError as problem:
        error = str(problem)
    everyone = gather_or_raise((str(path), step, data_json, bool(checksums)), error)
    if any(entry != everyone[0] for entry in everyone):
        raise ValueError(
            "checkpoint.save: ranks passed different path, step or data_state (or checksums=) "
            f"(rank 0: {everyone[0]}, this rank: {everyone[layout.rank]}); the data state is the global sample "
            "position, the same on every rank: pass the same values everywhere"
        )

    partial = directories.partial_path(path)
    raise_if_any(attempt(lambda: directories.prepare(path)) if layout.rank == 0 else None)
    raise_if_any(attempt(lambda: _write_rng(partial, layout)))
    try:
        with deliberate_sharded_tensors():
            dcp.save(
                as_checkpointable(state.entries),
                storage_writer=(writer := _RecordingWriter(partial, thread_count=writer_threads)),
                planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            )
    except CheckpointException as failed:  # DCP raises it on every rank, whichever rank failed
        os_error = _os_error_of(failed, path)
        if os_error is None:
            raise
        raise os_error from failed
    # DCP's last step is rank 0 writing its metadata after every rank reported its writes: from
    # here on every file but the train state is in place. Each rank hashes the files it wrote
    # (still in its page cache); rank 0 records every rank's sums.
    sums = None
    if checksums:
        sums = {}
        mine = [*writer.written, f"{RNG_DIR}/{rng_file(partial, layout.rank).name}"]
        error = attempt(lambda: sums.update(sums_of(partial, mine)))
        for rank_sums in gather_or_raise(sums, error):
            sums.update(rank_sums)
    error = None
    if layout.rank == 0:
        train_state = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "data_state": data_state,
            "extra": extra,
            "has_optimizer": optimizer is not None,
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "layout": dict(layout.sizes, world_size=layout.world_size),
            "schedule": pm.schedule.name,
            "virtual_stages": pm.schedule.virtual_stages,
            "tied": pm.state_map.ties,
            "never_drain": rule_state(pm),
            "mesh3d_version": _installed_version(),
            "torch_version": torch.__version__,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        error = attempt(lambda: _finish(partial, path, train_state, sums, keep_last, before_publish))
    raise_if_any(error)
    return str(path)


def _check_finite(pm: ParallelModel, layout: Layout) -> None:
    """A NaN or Inf weight saved is in every checkpoint after it: refuse it (raised on every rank)."""
    name = first_non_finite(pm.named_parameters())
    if name is not None:
        raise ValueError(
            f"checkpoint.save: parameter {name} holds NaN or Inf values (rank {layout.rank}, mesh coordinate "
            f"{layout.coordinate}); refusing to save non-finite weights. Resume from the previous checkpoint, "
            "with a lower learning rate or after checking the data"
        )


def _os_error_of(failed: CheckpointException, path: Path) -> OSError | None:
    """The first failing rank's OSError (a full disk, a lost mount), with where it happened, or None."""
    for rank, (error, _) in sorted(failed.failures.items()):
        if isinstance(error, OSError):
            return type(error)(
                error.errno,
                f"checkpoint.save: writing {path} failed on rank {rank}: {error.strerror or error}; it was not "
                "published, the previous checkpoint stays the newest",
            )
    return None


def _resolve_step(path: Path, step: int | None) -> int:
    if step is None:
        digits = re.search(r"(\d+)$", path.name)
        if digits is None:
            raise ValueError(
                f"checkpoint.save: pass step= (the name {path.name!r} ends in no step number to take it from); "
                "latest() and keep_last order checkpoints by step"
            )
        step = int(digits.group(1))
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint.save: step must be a non-negative int, got {step!r}")
    return step


def _check_count(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"checkpoint.save: {name} must be {'None or ' if allow_none else ''}an int >= 1, got {value!r}"
        )


def _write_rng(partial: Path, layout: Layout) -> None:
    file = rng_file(partial, layout.rank)
    file.parent.mkdir(exist_ok=True)
    write_json(file, rng_state(layout.device))


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer, remembering the files this rank wrote (to hash them, and only them)."""

    written: list[str] = []

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.written = sorted({result.storage_data.relative_path for result in future.value()})
        return future


def _finish(
    partial: Path,
    path: Path,
    train_state: dict,
    sums: dict[str, dict] | None,
    keep_last: int | None,
    before_publish: Callable[[Path], None] | None,
) -> None:
    write_json(partial / TRAIN_STATE_FILE, train_state)
    if sums is not None:
        write_manifest(partial, {**sums, **sums_of(partial, [directories.DCP_METADATA, TRAIN_STATE_FILE])})
    if before_publish is not None:
        before_publish(partial)
    directories.publish(partial, path)
    if keep_last is not None:
        directories.prune(path.parent, keep_last, keep=path)


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
    path = Path(path)
    layout = pm.layout
    pm.discard_in_flight()  # a never-drain schedule: what is in flight is replaced by what is loaded
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


def _installed_version() -> str:
    # From the package metadata, not `mesh3d.__version__`: importing the package's face from here
    # would run back up the house (mesh3d/__init__ imports checkpoint/).
    try:
        return importlib.metadata.version("mesh3d")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"
