"""What a shape run (stages on meta or fake tensors) does for the ops torch cannot run without values
or without a real kernel's dtype rules; a dispatch mode entered around the run, never the real step.

- `_grouped_mm` (transformers' grouped-mm experts, `F.grouped_mm`): torch's meta kernel checks the
  CUDA kernel's rules (both operands bf16, rows 16-byte aligned), while the CPU kernel (what the
  real run takes) multiplies fp32 of any size. The shape does not depend on either, so the shape
  run gives the output the kernel would (its sizes and dtype) without the meta kernel.
- `nonzero` (and so `torch.where(mask)`) on fake or meta tensors: the number of hits depends on
  values they do not have (FakeTensorMode and the meta kernel raise). The shape run takes the
  largest answer, every element a hit (torch's own opt-in `meta_nonzero_assume_all_nonzero`), so
  what follows sees each row once (an expert loop over its hits: each expert given every token),
  shapes an upper bound of the real run's.
- a scalar read (`.item()`, `int(t)`, `bool(t)`) on fake or meta tensors, where torch raises: 0
  for an integer (an index valid in any non-empty dimension), 0.0 for a float, True for a bool (the
  branch that computes something is the one whose shapes matter).

Each fallback is taken only where torch itself refused the op, so a run torch can do is unchanged.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

aten = torch.ops.aten


class ShapeRunOps(TorchDispatchMode):
    """Enter inside a FakeTensorMode (or around meta tensors): see the module docstring."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._grouped_mm.default and _without_values(args[:2]):
            return _grouped_mm_shape(*args, **kwargs)
        if func in _VALUE_DEPENDENT and _without_values(args[:1]):
            try:
                return func(*args, **kwargs)
            except (DynamicOutputShapeException, DataDependentOutputException, NotImplementedError, RuntimeError):
                return _VALUE_DEPENDENT[func](args[0])  # fake: the values are unknown; meta: refused outright
        return func(*args, **kwargs)


def _grouped_mm_shape(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The output the kernels give (torch's meta kernel's sizes: two 2-d operands grouped along the
    contraction by `offs`, a 2-d one grouped along its rows, two 3-d ones batched), its size check."""
    if mat_a.size(-1) != mat_b.size(-2):
        raise RuntimeError(f"_grouped_mm: contraction sizes differ: {tuple(mat_a.shape)} @ {tuple(mat_b.shape)}")
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        size = (offs.size(0), mat_a.size(0), mat_b.size(1))
    elif mat_a.dim() == 2:
        size = (mat_a.size(0), mat_b.size(-1))
    elif mat_b.dim() == 2:
        size = (mat_a.size(1), mat_b.size(1))
    else:
        size = (mat_a.size(0), mat_a.size(1), mat_b.size(-1))
    return torch.empty(size, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def _without_values(operands) -> bool:
    """On meta or fake tensors, or under a FakeTensorMode (which makes real operands fake): a run
    on real tensors takes the real kernel."""
    fake_mode = any(isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack())
    return fake_mode or any(t.is_meta or isinstance(t, FakeTensor) for t in operands)


def _every_element_a_hit(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty((tensor.numel(), tensor.dim()), dtype=torch.long, device=tensor.device)


def _some_scalar(tensor: torch.Tensor) -> bool | int | float:
    if tensor.dtype == torch.bool:
        return True
    return 0.0 if tensor.dtype.is_floating_point or tensor.dtype.is_complex else 0


# Ops whose result depends on values, and what a shape run takes when torch cannot give it.
_VALUE_DEPENDENT = {aten.nonzero.default: _every_element_a_hit, aten._local_scalar_dense.default: _some_scalar}
