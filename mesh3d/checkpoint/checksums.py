"""Checksums of a checkpoint's files: computed at save, verified before a load, kept in one JSON file.

A file damaged after it was written but kept at its size (a bad sector, a flipped bit in a copy)
passes every size check and would be loaded as if whole. Each file a checkpoint publishes gets a
CRC-32 (zlib, standard library) and its size in `checksums.json` beside it:

    {"algorithm": "crc32", "files": {"__0_0.distcp": {"size": 123, "crc32": "1a2b3c4d"}, ...}}

File names are relative to the directory, with "/" separators. The sums are computed in
threads: zlib releases the GIL while it hashes, so several files are hashed at once, and a file
just written is usually still in the page cache, so hashing it right after costs little disk.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHECKSUM_FILE = "checksums.json"
ALGORITHM = "crc32"
_CHUNK = 8 * 1024 * 1024
_MAX_THREADS = 8


def crc32_of(file: Path) -> tuple[int, str]:
    """(size in bytes, CRC-32 as 8 hex digits) of `file`, read in chunks."""
    crc, size = 0, 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(file, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, f"{crc:08x}"


def _threads(count: int, threads: int | None) -> int:
    return max(1, min(count, threads or min(_MAX_THREADS, os.cpu_count() or 1)))


def sums_of(directory: Path, names: Iterable[str], threads: int | None = None) -> dict[str, dict]:
    """{name: {"size", "crc32"}} for the files `names` (relative to `directory`), hashed in threads."""
    names = sorted(set(names))
    with ThreadPoolExecutor(_threads(len(names), threads)) as pool:
        results = list(pool.map(lambda name: crc32_of(directory / name), names))
    return {name: {"size": size, ALGORITHM: crc} for name, (size, crc) in zip(names, results)}


def write_manifest(directory: Path, sums: dict[str, dict]) -> None:
    """Write `checksums.json` into `directory` (fsynced: it is published with the files it covers)."""
    from mesh3d.checkpoint.train_state import write_json  # noqa: PLC0415 - train_state imports torch; keep this module light

    write_json(directory / CHECKSUM_FILE, {"algorithm": ALGORITHM, "files": sums})


class ManifestError(ValueError):
    """`checksums.json` is there but cannot be read: the manifest itself is damaged."""


def read_manifest(directory: Path) -> dict[str, dict] | None:
    """The recorded {name: {"size", "crc32"}} of `directory`, or None when it has no checksums.

    Raises ManifestError when the file is there but unreadable or not a manifest."""
    file = directory / CHECKSUM_FILE
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
        files = manifest["files"]
        if manifest.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"algorithm {manifest.get('algorithm')!r}, expected {ALGORITHM!r}")
        for name, entry in files.items():
            if not isinstance(entry.get("size"), int) or not isinstance(entry.get(ALGORITHM), str):
                raise ValueError(f"a bad entry for {name!r}: {entry!r}")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ManifestError(f"its checksum file {file} is unreadable ({type(error).__name__}: {error})") from None
    return files


def share(sums: dict[str, dict], rank: int, world_size: int) -> list[str]:
    """The names rank `rank` of `world_size` verifies: files dealt largest first, round robin, so
    every file is verified by exactly one rank and the bytes are spread evenly."""
    by_size = sorted(sums, key=lambda name: (-sums[name]["size"], name))
    return sorted(by_size[rank::world_size])


def first_mismatch(directory: Path, sums: dict[str, dict], names: Iterable[str], threads: int | None = None) -> str | None:
    """The first of `names` (in name order) whose file is missing, of another size or another
    CRC-32 than `sums` records, described with both values; None when all match."""
    names = sorted(names)

    def check(name: str) -> str | None:
        file = directory / name
        want = sums[name]
        try:
            size = os.stat(file).st_size
            if size != want["size"]:
                return f"{file} has {size} bytes, {want['size']} were written"
            _, crc = crc32_of(file)
        except FileNotFoundError:
            return f"{file} is missing"
        except OSError as error:
            return f"{file} cannot be read ({type(error).__name__}: {error})"
        if crc != want[ALGORITHM]:
            return f"{file} has another checksum than when it was written (crc32 {crc}, {want[ALGORITHM]} written): its contents changed"
        return None

    if not names:
        return None
    with ThreadPoolExecutor(_threads(len(names), threads)) as pool:
        found = list(pool.map(check, names))
    return next((problem for problem in found if problem), None)
