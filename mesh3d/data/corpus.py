"""Where token streams come from: the Python standard library, text files, token files; cached.

Every source ends as one 1-D numpy array of token ids (memory-mapped where it comes from disk).
Text is tokenized once and cached as a .npy file keyed by the files' names, sizes and mtimes
(token_cache.py), so a second run starts in milliseconds.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

from mesh3d.data.byte_tokenizer import ByteTokenizer
from mesh3d.data.token_cache import build_token_cache

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


def tokenize_files(
    paths: list[str | Path],
    tokenizer: ByteTokenizer | None = None,
    cache_dir: str | Path | None = None,
) -> np.ndarray:
    """Tokenize text files into one stream, each file ending with the end-of-document token.

    The result is cached under `cache_dir` (default: $MESH3D_CACHE or ~/.cache/mesh3d) and returned
    memory-mapped; see `build_token_cache` for JSONL and Parquet, Hugging Face tokenizers and
    parallel workers.
    """
    return build_token_cache(paths, tokenizer or ByteTokenizer(), cache_dir=cache_dir)


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
