"""A safetensors file streamed one tensor at a time (checkpoint/safetensors_stream.py) reads back
through safetensors' own reader with every tensor, dtype, shape and the metadata intact."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from mesh3d.checkpoint.safetensors_stream import StreamedSafetensors


def test_streamed_file_reads_back(tmp_path):
    tensors = {
        "b.weight": torch.randn(3, 5),
        "a.bias": torch.randn(7).to(torch.bfloat16),
        "c.ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d.flag": torch.tensor([True, False, True]),
        "e.half": torch.randn(1, 1, 3).to(torch.float16),
    }
    writer = StreamedSafetensors(
        tmp_path / "x.safetensors", {n: (t.shape, t.dtype) for n, t in tensors.items()}, {"format": "pt"}
    )
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    assert not (tmp_path / "x.safetensors.tmp").exists()
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(tensors)
        for name, tensor in tensors.items():
            read = f.get_tensor(name)
            assert read.dtype == tensor.dtype and torch.equal(read, tensor), name


def test_out_of_order_and_short_files_are_refused(tmp_path):
    entries = {"a": (torch.Size([2]), torch.float32), "b": (torch.Size([1]), torch.float32)}
    writer = StreamedSafetensors(tmp_path / "y.safetensors", entries, {})
    with pytest.raises(RuntimeError, match="b written out of order; expected a"):
        writer.write("b", torch.zeros(1))
    writer.write("a", torch.zeros(2))
    with pytest.raises(RuntimeError, match="closed after 1 of 2 tensors"):
        writer.close()
    assert not (tmp_path / "y.safetensors").exists()
