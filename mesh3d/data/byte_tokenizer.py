"""Byte-level tokenizer: every byte is a token, so any text encodes with no vocabulary file."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Token id = byte value (0..255). Byte 0 (NUL, absent from text) marks the end of a document.

    A vocabulary of 256 divides by every tensor-parallel degree up to 256.
    """

    name = "bytes-v1"
    vocab_size = 256
    eos_id = 0
    # What the token cache asks of every tokenizer (see HFTokenizer): the end-of-document id follows each document.
    separator = "eos"
    separator_id = eos_id
    dtype = np.uint8

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=self.dtype)

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, eos=byte {self.eos_id})"

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids)
        return data.replace(b"\x00", b"\n").decode("utf-8", errors="replace")
