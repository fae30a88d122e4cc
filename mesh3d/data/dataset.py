"""Fixed-length training samples cut from one token stream."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mesh3d.data.byte_tokenizer import ByteTokenizer
from mesh3d.data.corpus import load_token_file, stdlib_sources, tokenize_files
from mesh3d.data.token_cache import build_token_cache


class TokenDataset:
    """Sample i is the window tokens[i*L : i*L + L + 1]: inputs are its first L ids, targets the last L.

    Windows do not overlap (except the one token each shares with the next), so one pass over the
    samples is one pass over the data.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"TokenDataset: seq_len must be >= 1, got {seq_len}")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"TokenDataset: {len(tokens)} tokens cannot fill one sample of seq_len={seq_len} "
                f"(needs {seq_len + 1}); use more data or a shorter sequence"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of sample `index`, each int64 of shape (seq_len,)."""
        inputs, targets = self.batch([index])
        return inputs[0], targets[0]

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack the samples at `indices`: (inputs, targets), each int64 of shape (len, seq_len)."""
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len
        windows = np.asarray(self.tokens[starts + np.arange(self.seq_len + 1)], dtype=np.int64)
        windows = torch.from_numpy(windows)
        return windows[:, :-1], windows[:, 1:]

    @classmethod
    def from_stdlib(cls, seq_len: int, cache_dir: str | Path | None = None) -> "TokenDataset":
        """The default corpus: this Python's standard library sources, byte-tokenized."""
        return cls(tokenize_files(stdlib_sources(), ByteTokenizer(), cache_dir), seq_len)

    @classmethod
    def from_text_files(cls, paths, seq_len: int, cache_dir: str | Path | None = None) -> "TokenDataset":
        """Your own text files (a list of paths, or directories searched for *.txt, *.md and *.py)."""
        return cls(tokenize_files(paths, ByteTokenizer(), cache_dir), seq_len)

    @classmethod
    def from_corpus(
        cls,
        paths,
        seq_len: int,
        tokenizer=None,
        *,
        text_field: str = "text",
        cache_dir: str | Path | None = None,
        workers: int | None = None,
        progress: bool = False,
    ) -> "TokenDataset":
        """Text, JSONL and Parquet files, directories and globs, tokenized once into the token cache
        by `tokenizer` (default: bytes) in parallel workers; see `build_token_cache`."""
        tokens = build_token_cache(
            paths,
            tokenizer or ByteTokenizer(),
            text_field=text_field,
            cache_dir=cache_dir,
            workers=workers,
            progress=progress,
        )
        return cls(tokens, seq_len)

    @classmethod
    def from_token_file(cls, path: str | Path, seq_len: int, dtype=None) -> "TokenDataset":
        """A pre-tokenized file (.npy, or raw ids with `dtype`), memory-mapped."""
        return cls(load_token_file(path, dtype), seq_len)
