"""A shape run (meta or fake tensors) gives the real run's shapes where torch alone cannot run it:
fp32 grouped matmuls (transformers' grouped-mm experts), whose meta kernel insists on bf16 while the
CPU kernel takes fp32, and a data-dependent `nonzero` / scalar read (an expert loop over its hits)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mesh3d.pipeline.shape_ops import ShapeRunOps


def _grouped(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs)


def _operands(requires_grad: bool = False):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(6, 4, generator=generator, requires_grad=requires_grad)
    b = torch.randn(2, 4, 5, generator=generator).transpose(-2, -1).contiguous().transpose(-2, -1)
    return a, b.requires_grad_(requires_grad), torch.tensor([2, 6], dtype=torch.int32)


def test_fp32_grouped_mm_has_the_real_kernels_shape_and_dtype_on_fake_tensors():
    a, b, offs = _operands()
    real = _grouped(a, b, offs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError, match="BF16"):  # torch's meta kernel alone: the CUDA kernel's dtype rule
            _grouped(a, b, offs)
        with ShapeRunOps():
            fake = _grouped(a, b, offs)
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype) == ((6, 5), torch.float32)


def test_fp32_grouped_mm_backward_runs_on_fake_tensors():
    a, b, offs = _operands(requires_grad=True)
    with FakeTensorMode(allow_non_fake_inputs=True), ShapeRunOps():
        a, b = torch.empty_like(a, requires_grad=True), torch.empty_like(b, requires_grad=True)
        _grouped(a, b, offs).sum().backward()
        assert (a.grad.shape, a.grad.dtype, b.grad.shape) == (a.shape, torch.float32, b.shape)


def _expert_loop(hits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The shape of an eager expert loop: rows picked by data, each through its own expert."""
    out = torch.zeros_like(tokens)
    for expert in hits.any(dim=-1).nonzero():  # the experts some token picked (longcat_flash's loop)
        index = int(expert.item())
        (rows,) = torch.where(hits[index])
        out.index_add_(0, rows, tokens[rows] * (index + 1))
    return out


def test_a_data_dependent_loop_gives_its_output_shape_on_fake_tensors():
    hits, tokens = torch.tensor([[True, False, True], [False, False, True]]), torch.randn(3, 4)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_hits, fake_tokens = mode.from_tensor(hits), mode.from_tensor(tokens)
        with pytest.raises(Exception):  # noqa: B017 - FakeTensorMode alone: the number of hits is data
            _expert_loop(fake_hits, fake_tokens)
        with ShapeRunOps():
            fake = _expert_loop(fake_hits, fake_tokens)
    assert fake.shape == _expert_loop(hits, tokens).shape


def test_a_data_dependent_loop_gives_its_output_shape_on_meta_tensors():
    # A meta run (the trainer's FLOP count): torch's meta nonzero refuses; item() on meta too.
    hits, tokens = torch.ones(2, 3, dtype=torch.bool, device="meta"), torch.empty(3, 4, device="meta")
    with pytest.raises(NotImplementedError):
        _expert_loop(hits, tokens)
    with ShapeRunOps():
        assert _expert_loop(hits, tokens).shape == (3, 4)


def test_the_real_run_is_untouched():
    a, b, offs = _operands()
    with ShapeRunOps():
        inside = _grouped(a, b, offs)
        hits = torch.tensor([0, 3, 0, 1]).nonzero()
    assert torch.equal(inside, _grouped(a, b, offs)) and hits.flatten().tolist() == [1, 3]
