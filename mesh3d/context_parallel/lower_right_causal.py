"""Causal attention of queries that stand at the end of their keys, without a mask where a kernel can.

A context-parallel rank's queries are runs of consecutive positions (sequence_cut.py: a head chunk
and a tail chunk), and the keys sorted by position are the whole sequence. A run whose first query
stands at position p, attending to the first p + n keys, is causal aligned at the lower right: query
i sees keys 0..p + i. SDPA's `is_causal` aligns at the upper left, so that is not it; PyTorch's
`causal_lower_right` bias is, and on a GPU its flash and memory-efficient kernels take it without a
mask and skip the masked tiles: called here as that bias's dispatch calls them (Llama 3's and
torchtitan's context-parallel attention, too, is causal flash attention over chunks). Where no
such kernel takes the call (the CPU, a head dim the kernels refuse), the mask is built for the
call: the caller then keeps calls small (attention.py's MASK_PAIRS).

No call here passes through `F.scaled_dot_product_attention`: the mode that routes a model's SDPA
calls to context parallelism (sdpa_calls.py) would take them back, in a backward that runs under it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
from torch.nn.attention.bias import CausalVariant

_LOWER_RIGHT = int(CausalVariant.LOWER_RIGHT)  # the memory-efficient kernel's custom_mask_type


def _flash_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> bool:
    return q.is_cuda and bool(can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, enable_gqa)))


def _efficient_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    # the memory-efficient kernel takes equal head counts: q's heads, dtype and layout stand in for
    # K's and V's once repeated
    if not q.is_cuda or not k.shape[-1] == v.shape[-1] == q.shape[-1]:
        return False
    return bool(can_use_efficient_attention(SDPAParams(q, q, q, None, 0.0, False, False)))


def fused_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> bool:
    """Whether a lower-right causal call on tensors like these runs in a fused kernel, with no mask."""
    return _flash_takes(q, k, v, enable_gqa) or _efficient_takes(q, k, v)


def lower_right_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, enable_gqa: bool
) -> torch.Tensor:
    """SDPA of queries (batch, heads, L, dim) over keys (batch, kv_heads, S, dim), S >= L, query i
    seeing keys 0..S - L + i."""
    queries, keys = q.shape[-2], k.shape[-2]
    if k.shape[-3] != q.shape[-3] and not enable_gqa:
        raise ValueError(
            f"attention with {q.shape[-3]} query heads and {k.shape[-3]} key/value heads needs enable_gqa=True"
        )
    if queries == keys:  # aligned both ways
        return torch.ops.aten.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=scale, enable_gqa=enable_gqa)
    # The fused kernels' aten ops, called as CausalBias's own dispatch calls them, without building the
    # bias: a tensor subclass cannot be made under a dispatch mode ("selective" checkpointing's).
    if _flash_takes(q, k, v, enable_gqa):  # grouped K/V heads too; is_causal means lower right here
        dim = q.shape[-1]
        scale = dim**-0.5 if scale is None else scale
        pad = -dim % 8  # the kernel takes head dims in multiples of 8
        if pad:
            q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]
        return out[..., :dim]
    if _efficient_takes(q, k, v):
        if k.shape[-3] != q.shape[-3]:  # the kernel takes equal head counts
            groups = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
        needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        out = torch.ops.aten._efficient_attention_forward(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            None,
            None,
            None,
            None,
            None,
            0.0,
            _LOWER_RIGHT,
            needs_lse,
            scale=scale,
        )[0]
        return out.transpose(1, 2)
    mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries)
    return torch.ops.aten.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=scale, enable_gqa=enable_gqa)
