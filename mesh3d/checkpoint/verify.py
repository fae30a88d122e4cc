"""Check a checkpoint offline: `python -m mesh3d.checkpoint.verify DIR [DIR ...]`.

One process, no GPU and no process group: every file of the checkpoint is hashed (in threads)
against the checksums `save` recorded, and the train state and DCP's metadata are read and every
file they point into checked for its size, as `load` does before reading a tensor. A Hugging
Face directory written by `export_safetensors` is checked against its checksums.json.

Prints `whole: DIR` or `damaged: <the first damaged file and why>` (or `cannot verify: ...` for
a directory that is neither) for each directory; exit status 0 when every one is whole, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mesh3d.checkpoint.checksums import CHECKSUM_FILE, ManifestError, first_mismatch, read_manifest
from mesh3d.checkpoint.directories import DCP_METADATA
from mesh3d.checkpoint.integrity import DamagedCheckpoint, check


def verify(path: str | Path) -> str | None:
    """None when the checkpoint (or safetensors export) at `path` is whole; else the first problem.

    Raises FileNotFoundError when `path` is neither a checkpoint nor a directory with checksums."""
    path = Path(path)
    if (path / DCP_METADATA).is_file():
        try:
            check(path)
        except DamagedCheckpoint as damage:
            return str(damage)
        return None
    try:
        sums = read_manifest(path)
    except ManifestError as damage:
        return f"{path}: {damage}"
    if sums is None:
        raise FileNotFoundError(
            f"{path} is not a mesh3d checkpoint (no {DCP_METADATA}) and holds no {CHECKSUM_FILE}: nothing to verify"
        )
    mismatch = first_mismatch(path, sums, sums)
    return f"{path}: {mismatch}" if mismatch else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mesh3d.checkpoint.verify",
        description="Check mesh3d checkpoints (or safetensors exports) against the checksums written with them.",
    )
    parser.add_argument("paths", nargs="+", metavar="DIR", help="a checkpoint directory, e.g. ckpt/step100")
    args = parser.parse_args(argv)
    all_whole = True
    for path in args.paths:
        try:
            problem = verify(path)
        except (FileNotFoundError, ValueError) as error:  # not a checkpoint, or one of another format
            all_whole = False
            print(f"cannot verify: {error}", flush=True)
            continue
        if problem:
            all_whole = False
            print(f"damaged: {problem}", flush=True)
        else:
            note = (
                "" if (Path(path) / CHECKSUM_FILE).is_file() else f" (no {CHECKSUM_FILE}: sizes checked, not contents)"
            )
            print(f"whole: {path}{note}", flush=True)
    return 0 if all_whole else 1


if __name__ == "__main__":
    sys.exit(main())
