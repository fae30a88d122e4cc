"""Where token streams come from: the Python standard library, text files, token files; cached.

Every source ends as one 1-D numpy array of token ids (memory-mapped where it comes from disk).
Text is tokenized once and cached as a .npy file keyed by the files' names, sizes and mtimes,
so a second run starts in milliseconds.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

from mesh3d.data.tokenizer import ByteTokenizer

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources() -> list[Path]:
    """The `.py` files of this Python's standard library, in a stable order (no third-party code)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    if not files:
        raise FileNotFoundError(f"no .py files found under the standard library at {root}")
    return files


def default_cache_dir() -> Path:
    return Path(os.environ.get("MESH3D_CACHE", Path.home() / ".cache" / "mesh3d"))


def tokenize_files(
    paths: list[str | Path],
    tokenizer: ByteTokenizer | None = None,
    cache_dir: str | Path | None = None,
) -> np.ndarray:
    """Tokenize text files into one stream, each file ending with the end-of-document token.

    The result is cached under `cache_dir` (default: $MESH3D_CACHE or ~/.cache/mesh3d) and returned
    memory-mapped. Concurrent ranks may build the same cache: each writes a private temporary
    file and renames it into place, so readers never see a partial file.
    """
    tokenizer = tokenizer or ByteTokenizer()
    paths = [Path(p) for p in paths]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"text files not found: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cached = cache_dir / f"tokens-{_fingerprint(paths, tokenizer)}.npy"
    if not cached.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        eos = np.array([tokenizer.eos_id], dtype=tokenizer.dtype)
        pieces = []
        for path in paths:
            pieces += [tokenizer.encode(path.read_bytes()), eos]
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".npy.tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, np.concatenate(pieces))
        os.replace(tmp, cached)
    return np.load(cached, mmap_mode="r")


def load_token_file(path: str | Path, dtype: str | np.dtype | None = None) -> np.ndarray:
    """A pre-tokenized file, memory-mapped: a `.npy` array, or raw ids of the given `dtype`."""
    path = Path(path)
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
    else:
        if dtype is None:
            raise ValueError(f"{path}: a raw token file needs its dtype (e.g. dtype='uint16'); or save it as .npy")
        tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    if tokens.ndim != 1:
        raise ValueError(f"{path}: expected a 1-D array of token ids, got shape {tokens.shape}")
    return tokens


def _fingerprint(paths: list[Path], tokenizer: ByteTokenizer) -> str:
    digest = hashlib.sha256(tokenizer.name.encode())
    for path in paths:
        stat = path.stat()
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]
