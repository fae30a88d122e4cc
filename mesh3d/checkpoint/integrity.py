"""Is a checkpoint whole? Its files checked before any tensor is read, with the same verdict on every rank.

A checkpoint can be damaged after it was published: a disk that filled, a copy cut short, a
file removed by hand. DCP would then fail deep inside a read, on the ranks that read the bad
file only, while the others wait for them. Here every rank checks the train state and DCP's
metadata can be read, and that every file the metadata points into exists and holds the bytes
it is said to hold (sizes only: cheap, a stat per file); one all-gather then gives every rank
the first problem found, raised as DamagedCheckpoint naming the checkpoint and the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from mesh3d.distributed.agree import gather_or_raise
from mesh3d.checkpoint.directories import DCP_METADATA
from mesh3d.checkpoint.train_state import TRAIN_STATE_FILE, read_train_state


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files are missing, cut short or unreadable; raised on every rank."""


def read_whole(path: Path) -> tuple[dict, Metadata]:
    """The train state and DCP metadata of the checkpoint at `path`, after checking every file it
    needs is present and long enough. Call on every rank. Raises DamagedCheckpoint on every rank."""
    train_state = metadata = problem = None
    try:
        train_state, metadata = _read(path)
        problem = _missing_bytes(path, metadata)
    except DamagedCheckpoint as damage:
        problem = str(damage)
    problems = [p for p in gather_or_raise(problem) if p]
    if problems:
        raise DamagedCheckpoint(problems[0])
    return train_state, metadata


def _read(path: Path) -> tuple[dict, Metadata]:
    try:
        train_state = read_train_state(path)
    except FileNotFoundError:
        if not (path / DCP_METADATA).is_file():
            raise  # not a checkpoint at all: read_train_state's message says so
        raise DamagedCheckpoint(f"checkpoint {path}: its train state file {path / TRAIN_STATE_FILE} is missing") from None
    except (OSError, json.JSONDecodeError) as error:
        raise DamagedCheckpoint(f"checkpoint {path}: cannot read its train state ({type(error).__name__}: {error})") from None
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:  # noqa: BLE001 - a cut or corrupt pickle raises anything
        raise DamagedCheckpoint(
            f"checkpoint {path}: its metadata file {path / DCP_METADATA} is unreadable ({type(error).__name__}: {error})"
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
