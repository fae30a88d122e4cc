"""The two halves of a save, shared by `save` and `async_save`: prepared in the caller, then written.

`prepare` runs in the calling thread, on every rank: it flushes a never-drain schedule, checks the
arguments and the weights, agrees with every rank (one all-gather: a problem anywhere is raised
everywhere, before anything is written), takes the train state and RNG states as they are now and
has rank 0 prepare the partial directory (directories.py). `write_and_publish` then writes the
tensors with DCP, hashes the files, and has rank 0 write the train state and manifest, publish and
prune; every rank learns the outcome. `save` runs it in the caller on the usual groups;
`async_save` on a host copy of the tensors, in a background thread, on a process group of its own.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from mesh3d.checkpoint import directories
from mesh3d.checkpoint.checksums import sums_of, write_manifest
from mesh3d.checkpoint.flat_state import flat_state
from mesh3d.checkpoint.kept_versions import kept_entries, rule_state
from mesh3d.checkpoint.train_state import (
    FORMAT,
    RNG_DIR,
    TRAIN_STATE_FILE,
    VERSION,
    check_json,
    rng_file,
    rng_state,
    write_json,
)
from mesh3d.distributed.agree import attempt, gather_or_raise, raise_if_any
from mesh3d.mesh import Layout
from mesh3d.parallel_model import ParallelModel
from mesh3d.step.finite import first_non_finite


@dataclass
class Prepared:
    """A save checked and agreed on by every rank, its directory ready: what is left is the write."""

    path: Path
    partial: Path
    rank: int
    entries: dict[str, object]  # the flat state DCP writes: live tensors (async_save writes a host copy)
    rng: dict  # this rank's RNG states at the call
    train_state: dict | None  # rank 0's, None on the others
    keep_last: int | None
    writer_threads: int
    before_publish: Callable[[Path], None] | None
    checksums: bool


def prepare(
    path: Path,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer | None,
    *,
    step: int | None,
    data_state: Any,
    extra: Any,
    keep_last: int | None,
    writer_threads: int,
    before_publish: Callable[[Path], None] | None,
    checksums: bool,
) -> Prepared:
    """Everything of a save before the write (module docstring); raises on every rank, writing nothing."""
    layout = pm.layout
    pm.flush()  # a never-drain schedule: every update in flight applied (it changes no update rule)
    # Every check first, on every rank; one all-gather then shows each rank what all found, so a
    # problem on any rank is raised on all of them before anything is written.
    state = data_json = extra_json = error = None
    try:
        step = _resolve_step(path, step)
        _check_count("keep_last", keep_last, allow_none=True)
        _check_count("writer_threads", writer_threads)
        if before_publish is not None and not callable(before_publish):
            raise ValueError(f"checkpoint.save: before_publish must be callable or None, got {before_publish!r}")
        data_json = check_json(data_state, "data_state")
        if layout.rank == 0:
            extra_json = check_json(extra, "extra")  # rank 0's is the one saved
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
    train_state = None
    if layout.rank == 0:
        # From the JSON text just checked: the values as they are now, whatever the caller changes later.
        train_state = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "data_state": json.loads(data_json),
            "extra": json.loads(extra_json),
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
    raise_if_any(attempt(lambda: directories.prepare(path)) if layout.rank == 0 else None)
    return Prepared(
        path,
        directories.partial_path(path),
        layout.rank,
        state.entries,
        rng_state(layout.device),
        train_state,
        keep_last,
        writer_threads,
        before_publish,
        bool(checksums),
    )


def write_and_publish(
    prepared: Prepared, checkpointable: dict[str, object], group: dist.ProcessGroup | None = None
) -> str:
    """Write `checkpointable` (the prepared entries, or a copy, as DCP takes them) and publish; every
    collective on `group` (None: the usual ones). Raises on every rank what failed on any."""
    partial, path = prepared.partial, prepared.path
    raise_if_any(attempt(lambda: _write_rng(partial, prepared.rank, prepared.rng)), group)
    try:
        dcp.save(
            checkpointable,
            storage_writer=(writer := _RecordingWriter(partial, thread_count=prepared.writer_threads)),
            planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            process_group=group,
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
    if prepared.checksums:
        sums = {}
        mine = [*writer.written, f"{RNG_DIR}/{rng_file(partial, prepared.rank).name}"]
        error = attempt(lambda: sums.update(sums_of(partial, mine)))
        for rank_sums in gather_or_raise(sums, error, group):
            sums.update(rank_sums)
    error = None
    if prepared.rank == 0:
        error = attempt(lambda: _finish(prepared, sums))
    raise_if_any(error, group)
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


def _write_rng(partial: Path, rank: int, state: dict) -> None:
    file = rng_file(partial, rank)
    file.parent.mkdir(exist_ok=True)
    write_json(file, state)


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer, remembering the files this rank wrote (to hash them, and only them)."""

    written: list[str] = []

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.written = sorted({result.storage_data.relative_path for result in future.value()})
        return future


def _finish(prepared: Prepared, sums: dict[str, dict] | None) -> None:
    """Rank 0, once every rank's files are written: the train state, the manifest, the hook, the name."""
    partial, path = prepared.partial, prepared.path
    write_json(partial / TRAIN_STATE_FILE, prepared.train_state)
    if sums is not None:
        write_manifest(partial, {**sums, **sums_of(partial, [directories.DCP_METADATA, TRAIN_STATE_FILE])})
    if prepared.before_publish is not None:
        prepared.before_publish(partial)
    directories.publish(partial, path)
    if prepared.keep_last is not None:
        directories.prune(path.parent, prepared.keep_last, keep=path)


def _installed_version() -> str:
    # From the package metadata, not `mesh3d.__version__`: importing the package's face from here
    # would run back up the house (mesh3d/__init__ imports checkpoint/).
    try:
        return importlib.metadata.version("mesh3d")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"
