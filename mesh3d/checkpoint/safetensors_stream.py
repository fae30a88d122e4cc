"""A safetensors file written one tensor at a time, so the writer never holds a whole file.

`safetensors.torch.save_file` takes every tensor of a file at once (5 GiB by default, the whole
model for a small one). The format is simple enough to stream: an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then the tensors' bytes
back to back in that order. The header depends only on names, shapes and dtypes, which every
rank knows before any tensor is gathered, so it is written first and each tensor's bytes follow
as they arrive. `safetensors.safe_open` and transformers read the result (tested).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

# safetensors' names for torch's dtypes
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class StreamedSafetensors:
    """Write `entries` ({name: (shape, dtype)}, in file order) to `path` with `write(name, tensor)`
    in the same order, then `close()`: the file appears under its name only once complete."""

    def __init__(self, path: Path, entries: dict[str, tuple[torch.Size, torch.dtype]], metadata: dict[str, str]):
        self._path = path
        self._temporary = path.with_name(path.name + ".tmp")
        self._order = list(entries)
        self._next = 0
        header: dict[str, object] = {"__metadata__": metadata}
        offset = 0
        for name, (shape, dtype) in entries.items():
            size = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as save_file pads it
        self._file = open(self._temporary, "wb")
        self._file.write(struct.pack("<Q", len(encoded)))
        self._file.write(encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor's bytes (in the order the entries were given)."""
        if self._next >= len(self._order) or self._order[self._next] != name:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing more"
            raise RuntimeError(f"{self._path}: {name} written out of order; expected {expected}")
        self._next += 1
        data = tensor.detach().cpu().contiguous().reshape(-1)
        self._file.write(memoryview(data.view(torch.uint8).numpy()))

    def close(self) -> None:
        """Finish the file: flushed, synced and renamed into place."""
        if self._next != len(self._order):
            self._file.close()
            raise RuntimeError(f"{self._path}: closed after {self._next} of {len(self._order)} tensors")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._temporary, self._path)

    def abandon(self) -> None:
        """Drop a file left half-written by a failure."""
        self._file.close()
        self._temporary.unlink(missing_ok=True)
