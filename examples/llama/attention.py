"""Attention of the LLaMA example (model.py): rotary positions in Hugging Face's rotate-half layout
(Llama 3.1's frequency scaling too), grouped-query attention through SDPA, and its masks: causal,
causal after a KV cache's positions, block-causal over packed documents.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from examples.llama.config import ModelArgs
from examples.llama.kv_cache import LayerCache


def rope_cache(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """cos and sin of every position, shape (max_seq_len, 2, head_dim), rotate-half layout."""
    half = torch.arange(0, args.head_dim, 2, dtype=torch.float64, device=device) / args.head_dim
    inv_freq = 1.0 / (args.rope_theta**half)
    if args.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, args.rope_scaling)
    positions = torch.arange(args.max_seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(positions, inv_freq)  # float64: exact angles at large positions
    cos, sin = angles.cos().float(), angles.sin().float()
    return torch.stack([torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)], dim=1)


def _llama3_scaled(inv_freq: torch.Tensor, scaling) -> torch.Tensor:
    """Llama 3.1's rule: keep high frequencies, divide low ones by `factor`, blend in between."""
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    middle = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(middle, blended, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of the last dim; computed in the table's precision, returned in x's."""
    first, second = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-second, first], dim=-1) * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: LayerCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (batch, seq, dim) -> (batch, seq, dim). With a cache (generation), x holds the positions
        after the cached ones: they are rotated for where they sit and attend to every earlier one.
        `rope` is the table (max_seq_len, 2, head_dim), or each token's row of it (batch, seq, 2,
        head_dim) where positions are given; `mask` (batch, 1, seq, seq) bool: which keys each query
        sees (default: causal)."""
        q, k, v = (rearrange(w(x), "b s (h d) -> b h s d", d=self.head_dim) for w in (self.wq, self.wk, self.wv))
        gqa = q.shape[1] != k.shape[1]
        if rope.dim() == 4:  # per-token rows: positions were given
            cos, sin = rope.unsqueeze(1).unbind(3)  # (batch, 1 for the heads, seq, head_dim)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
            return self.wo(rearrange(out, "b h s d -> b s (h d)"))
        start = cache.start if cache is not None else 0
        seq_len = start + q.shape[-2]
        if seq_len > rope.shape[0]:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's max_seq_len={rope.shape[0]}; "
                f"build the model with max_seq_len >= {seq_len}"
            )
        cos, sin = rope[start:seq_len].unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = _cached_attention(q, *cache.extend(k, v), start)
        return self.wo(rearrange(out, "b h s d -> b s (h d)"))


def _cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Queries at positions start.. attending to keys 0..: query i sees keys up to start + i."""
    gqa = q.shape[1] != k.shape[1]
    if start == 0:  # the prompt: queries and keys are the same positions
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    # is_causal would align the mask to the top-left corner; ours ends at the bottom-right.
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(diagonal=start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) document ids -> (batch, 1, seq, seq) bool: query i sees key j <= i of its own
    document. Dense, for SDPA: exact on every backend, and every query sees itself, so no row is
    empty (an empty row would give NaN)."""
    seq = document_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    return (same & causal).unsqueeze(1)
