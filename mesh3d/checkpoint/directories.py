"""Checkpoint directories: written under a temporary name, published by one rename, found, pruned.

A save writes into `<root>/.<name>.partial` and, once every rank has finished, rank 0 renames it
to `<root>/<name>`. A rename within one directory is atomic on POSIX filesystems, so a reader
sees either no `<name>` or a complete one: a process killed mid-save leaves only a `.partial`
directory, which `latest` ignores and the next save in the same root removes. A checkpoint is
complete when it holds DCP's `.metadata` and `train_state.json` and its name does not start with
a dot.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from mesh3d.checkpoint.train_state import TRAIN_STATE_FILE

PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
DCP_METADATA = ".metadata"


def partial_path(path: Path) -> Path:
    return path.parent / f".{path.name}{PARTIAL_SUFFIX}"


def is_complete_contents(path: Path) -> bool:
    return (path / DCP_METADATA).is_file() and (path / TRAIN_STATE_FILE).is_file()


def is_complete(path: Path) -> bool:
    return not path.name.startswith(".") and is_complete_contents(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare(path: Path) -> Path:
    """Rank 0, before a save: remove what crashed saves left in the root; an empty partial directory.

    An existing `path` that is not a checkpoint (nor empty) is refused: publishing would replace it.
    """
    if path.exists() and not (path.is_dir() and (is_complete_contents(path) or not any(path.iterdir()))):
        raise ValueError(
            f"checkpoint.save: {path} exists and is not a mesh3d checkpoint; saving there would replace it: "
            "choose another path (e.g. a step directory inside it)"
        )
    root = path.parent
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.iterdir():
        if not leftover.name.startswith("."):
            continue
        if leftover.name.endswith(REPLACED_SUFFIX):
            original = root / leftover.name[1 : -len(REPLACED_SUFFIX)]
            if not original.exists() and is_complete_contents(leftover):
                os.rename(leftover, original)  # a crash between publish's two renames: put it back
            else:
                shutil.rmtree(leftover, ignore_errors=True)
        elif leftover.name.endswith((PARTIAL_SUFFIX, ".pruned")):
            shutil.rmtree(leftover, ignore_errors=True)
    partial = partial_path(path)
    partial.mkdir()
    return partial


def publish(partial: Path, path: Path) -> None:
    """Rank 0, after every rank wrote its part: make the checkpoint visible under its name.

    An existing checkpoint of the same name is moved aside first and removed after; a crash in
    between leaves it under a dot-name (ignored by `latest`), never a mix of old and new files.
    """
    _fsync_dir(partial)
    replaced = None
    if path.exists():
        replaced = path.parent / f".{path.name}{REPLACED_SUFFIX}"
        os.rename(path, replaced)
    os.rename(partial, path)
    _fsync_dir(path.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _step_of(path: Path) -> int:
    """The saved step; for an unreadable train state (a damaged checkpoint, still listed so that
    loading it says what is wrong) the number its name ends with, as `save` defaults it."""
    try:
        return int(json.loads((path / TRAIN_STATE_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        digits = re.search(r"(\d+)$", path.name)
        return int(digits.group(1)) if digits else -1


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints directly under `root`, oldest first (by saved step, then name)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: (_step_of(p), p.name))


def latest(root: str | os.PathLike) -> str | None:
    """The path of the complete checkpoint with the highest step under `root`, or None.

    A save that was interrupted (a crash, a kill) is never returned: it never got its name.
    This lists `root` on the calling process only and does not read the checkpoint's files: to
    resume a job, `mesh3d.train.resume_latest` takes rank 0's listing on every rank and passes
    over a damaged checkpoint to the next older one.
    """
    found = complete_checkpoints(root)
    return str(found[-1]) if found else None


def prune(root: Path, keep_last: int, keep: Path) -> list[Path]:
    """Keep `keep` (the checkpoint just written, whatever its step) and the keep_last - 1 newest other
    complete checkpoints under `root`; remove the rest and return them."""
    others = [p for p in complete_checkpoints(root) if p.resolve() != keep.resolve()]
    removed = others[: max(0, len(others) - (keep_last - 1))]
    for old in removed:
        # Rename first so a crash mid-removal never leaves a complete-looking half checkpoint.
        doomed = old.parent / f".{old.name}.pruned"
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return removed
