"""Is a checkpoint whole? Its files checked before any tensor is read, with the same verdict on every rank.

A checkpoint can be damaged after it was published: a disk that filled, a copy cut short, a
file removed by hand, or bytes changed in place (a bad sector, a flipped bit in a copy) with the
size kept. DCP would then fail deep inside a read, on the ranks that read the bad file only,
while the others wait for them, or load the changed bytes without a word. Here, before any
tensor is read:

- the checksums `save` recorded (checksums.py) are verified: every rank hashes the train state
  and DCP's metadata (small, and about to be parsed), and the data files are dealt out among the
  ranks, so each file is hashed by one rank and a load under another world size still checks
  every file;
- the train state and DCP's metadata are read, and every file the metadata points into must
  exist, hold the bytes it is said to hold and be covered by a checksum;

one all-gather then gives every rank the first problem found, raised as DamagedCheckpoint naming
the checkpoint and the file. A checkpoint saved before mesh3d wrote checksums has its sizes
checked only, with a one-line notice.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from mesh3d.checkpoint.checksums import CHECKSUM_FILE, ManifestError, first_mismatch, read_manifest, share
from mesh3d.checkpoint.directories import DCP_METADATA
from mesh3d.checkpoint.train_state import TRAIN_STATE_FILE, read_train_state
from mesh3d.distributed.agree import gather_or_raise

_NOTICED: set[str] = set()


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files are missing, cut short, changed or unreadable; raised on every rank."""


def read_whole(path: Path) -> tuple[dict, Metadata]:
    """The train state and DCP metadata of the checkpoint at `path`, after checking every file it
    needs is present, long enough and (when it has checksums) unchanged. Call on every rank.
    Raises DamagedCheckpoint on every rank."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    train_state = metadata = problem = None
    checksummed = True
    try:
        train_state, metadata, checksummed = check(path, rank, world_size)
    except DamagedCheckpoint as damage:
        problem = str(damage)
    problems = [p for p in gather_or_raise(problem) if p]
    if problems:
        raise DamagedCheckpoint(problems[0])
    if not checksummed and rank == 0 and str(path) not in _NOTICED:
        _NOTICED.add(str(path))
        print(
            f"notice: checkpoint {path} has no {CHECKSUM_FILE} (saved before mesh3d checksummed checkpoints): "
            "its files' sizes are checked, not their contents",
            file=sys.stderr,
            flush=True,
        )
    return train_state, metadata


def check(path: Path, rank: int = 0, world_size: int = 1) -> tuple[dict, Metadata, bool]:
    """This rank's part of the check: (train state, metadata, whether the checkpoint has checksums).

    Rank `rank` of `world_size` hashes the train state, the metadata and its share of the other
    files; with the defaults (one process, as `python -m mesh3d.checkpoint.verify` runs it) every
    file. Raises DamagedCheckpoint naming the first problem this rank found."""
    try:
        sums = read_manifest(path)
    except ManifestError as damage:
        raise DamagedCheckpoint(f"checkpoint {path}: {damage}") from None
    if sums is not None:
        parsed_here = [name for name in (TRAIN_STATE_FILE, DCP_METADATA) if name in sums]
        others = {name: entry for name, entry in sums.items() if name not in parsed_here}
        mismatch = first_mismatch(path, sums, [*parsed_here, *share(others, rank, world_size)])
        if mismatch:
            raise DamagedCheckpoint(f"checkpoint {path}: {mismatch}")
    train_state, metadata = _read(path)
    problem = _missing_bytes(path, metadata)
    if problem is None and sums is not None:
        problem = _unchecked(path, metadata, sums)
    if problem:
        raise DamagedCheckpoint(problem)
    return train_state, metadata, sums is not None


def _unchecked(path: Path, metadata: Metadata, sums: dict[str, dict]) -> str | None:
    """A file the checkpoint needs that its checksum file does not cover (an edited manifest, a
    file swapped in): its contents could not be checked."""
    needed = {TRAIN_STATE_FILE, DCP_METADATA, *(info.relative_path for info in (metadata.storage_data or {}).values())}
    missing = sorted(needed - set(sums))
    if missing:
        return (
            f"checkpoint {path}: its checksum file {path / CHECKSUM_FILE} records no checksum for {path / missing[0]}"
        )
    return None


def _read(path: Path) -> tuple[dict, Metadata]:
    try:
        train_state = read_train_state(path)
    except FileNotFoundError:
        if not (path / DCP_METADATA).is_file():
            raise  # not a checkpoint at all: read_train_state's message says so
        raise DamagedCheckpoint(
            f"checkpoint {path}: its train state file {path / TRAIN_STATE_FILE} is missing"
        ) from None
    except (OSError, json.JSONDecodeError) as error:
        raise DamagedCheckpoint(
            f"checkpoint {path}: cannot read its train state ({type(error).__name__}: {error})"
        ) from None
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:  # noqa: BLE001 - a cut or corrupt pickle raises anything
        raise DamagedCheckpoint(
            f"checkpoint {path}: its metadata file {path / DCP_METADATA} is unreadable "
            f"({type(error).__name__}: {error})"
        ) from None
    return train_state, metadata


def _missing_bytes(path: Path, metadata: Metadata) -> str | None:
    """The first file the metadata points into that is missing or shorter than its last record."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = path / name
        try:
            size = os.stat(file).st_size
        except FileNotFoundError:
            return f"checkpoint {path}: its shard file {file} is missing"
        if size < end:
            return f"checkpoint {path}: its shard file {file} is cut short ({size} bytes, {end} needed)"
    return None
