"""Mixed precision: fp32 master weights, compute in a low-precision dtype, reductions in another.

torch's FSDP2 `MixedPrecisionPolicy` does the work: the sharded (or, under DDP, replicated)
parameters the optimizer updates keep their dtype; each forward gathers them cast to
`param_dtype`; gradients are computed in it, accumulated and reduced in `reduce_dtype`, and handed
back in the parameters' dtype. mesh3d applies the policy for every layout: with dp = 1 each stage
is wrapped over the one-rank dp axis all the same, so pipeline- and tensor-parallel runs get the
same mixed precision as data-parallel ones (torchtitan refuses mixed precision without FSDP).

What crosses a pipeline stage boundary is then in `param_dtype` too (half the bytes of fp32 for
bf16): the receiving buffers are sized from the meta stages with their parameters cast the same way.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

COMPUTE_DTYPES = (torch.bfloat16, torch.float32)
REDUCE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class MixedPrecision:
    """The compute and reduction dtypes; `enabled` when the compute dtype differs from the
    parameters' (a reduce_dtype alone takes effect only where dp > 1 wraps the stages anyway)."""

    param_dtype: torch.dtype | None  # None: compute in the parameters' dtype
    reduce_dtype: torch.dtype

    @classmethod
    def resolve(cls, model: nn.Module, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype) -> MixedPrecision:
        """Check parallelize's dtype arguments against the (meta) model; pure, the same on every rank."""
        if param_dtype is torch.float16:
            raise ValueError(
                "param_dtype=torch.float16 needs a loss scaler (fp16 gradients underflow), which mesh3d does not "
                "have; use param_dtype=torch.bfloat16, which has fp32's exponent range and needs none"
            )
        if param_dtype is not None and param_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"param_dtype={param_dtype}; choose None (the model's dtype), torch.bfloat16 or torch.float32"
            )
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype={reduce_dtype}; choose torch.float32 (default) or torch.bfloat16")
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if param_dtype is not None and dtypes and dtypes != {torch.float32}:
            raise ValueError(
                f"param_dtype={param_dtype} keeps fp32 master weights, "
                f"but the model's parameters are {sorted(map(str, dtypes))}; "
                "build the model in fp32 (the default) and let param_dtype set the compute dtype"
            )
        model_dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
        return cls(None if param_dtype == model_dtype else param_dtype, reduce_dtype)

    @property
    def enabled(self) -> bool:
        return self.param_dtype is not None

    def policy(self, root: bool) -> MixedPrecisionPolicy:
        """FSDP2's policy for a block (root=False) or a stage (root=True).

        Only a stage casts its floating inputs (the activation from the previous stage): a block's
        other inputs, such as a rotary table, keep their precision, and its activation input is
        already in param_dtype.
        """
        return MixedPrecisionPolicy(
            param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype, cast_forward_inputs=root
        )

    def computed(self, meta_stages: list[nn.Module]) -> list[nn.Module]:
        """The meta stages as they compute: parameters (not buffers) in param_dtype, as the policy
        gathers them. Copies, so the meta stages keep the dtypes the state map reports."""
        if not self.enabled:
            return meta_stages
        cast = []
        for stage in meta_stages:
            stage = copy.deepcopy(stage)
            for module in stage.modules():
                for name, param in module._parameters.items():
                    if param is not None and param.is_floating_point():
                        module._parameters[name] = nn.Parameter(
                            param.detach().to(self.param_dtype), requires_grad=param.requires_grad
                        )
            cast.append(stage)
        return cast

    def __str__(self) -> str:
        return f"param_dtype={self.param_dtype} reduce_dtype={self.reduce_dtype}"
