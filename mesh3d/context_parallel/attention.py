"""Attention over the whole sequence from a rank that holds a chunk of it: K and V all-gathered.

Llama 3's and torchtitan's choice among context-parallel attentions: each rank gathers every
rank's keys and values (one all-gather per layer, both at once), attends with its own queries
under the mask of their global positions, and in backward sums each key's and value's gradient
back to the rank that owns it (one reduce-scatter, in fp32). The gathered K and V are not kept
for backward: backward gathers them again and recomputes the attention, so besides its own chunk
a rank holds one layer's whole-sequence K and V at a time, forward and backward alike (the price:
the attention's forward runs twice, as under activation checkpointing).

The keys stay in gathered order (rank after rank), not sequence order: attention sums over keys,
so their order changes nothing but the rounding; the mask follows each key's global position.

Every rank of the group must call `attend` the same number of times in the same order (each
block's attention, microbatch by microbatch, as the schedule runs them): the collectives pair up
by order. Each call also carries the rank's verdict on the mask (sdpa_calls.py) inside the same
all-gather, so a mask one rank cannot extend is refused by every rank of the group together,
never a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GatheredAttention:
    """What an attention call needs besides q, k and v: the cp group, and how to build the mask of
    this rank's queries against every gathered key (None: no mask, every key seen)."""

    group: dist.ProcessGroup
    cp: int
    mask: Callable[[torch.device], torch.Tensor | None]
    scale: float | None
    enable_gqa: bool
    # this rank's verdict on the call's mask (sdpa_calls.py), shared in the gather and read there (a
    # host sync); None where the call has no mask to check (is_causal): nothing is read
    verdict: int | None
    refuse: Callable[[list[int]], None]  # raises on every rank when the verdicts say so


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: GatheredAttention) -> torch.Tensor:
    """SDPA of this rank's queries (batch, heads, chunk, dim) over the whole sequence's keys and values."""
    return _GatheredAttention.apply(q, k, v, call)


def _gather_kv(k: torch.Tensor, v: torch.Tensor, call: GatheredAttention, check: bool) -> tuple:
    """Every rank's k and v, concatenated along the sequence rank after rank (and, where `check`,
    every rank's verdict on the mask, refused together)."""
    verdict = k.new_full((1,), float(call.verdict or 0))
    flat = torch.cat([k.reshape(-1), v.reshape(-1), verdict])
    gathered = flat.new_empty(call.cp * flat.numel())
    dist.all_gather_single(gathered, flat, group=call.group)
    rows = gathered.view(call.cp, -1)
    if check and call.verdict is not None:
        call.refuse([int(x) for x in rows[:, -1].tolist()])
    n = k.numel()
    k_all = _along_sequence(rows[:, :n], k.shape, call.cp)
    v_all = _along_sequence(rows[:, n : n + v.numel()], v.shape, call.cp)
    return k_all, v_all


def _along_sequence(rows: torch.Tensor, shape: torch.Size, cp: int) -> torch.Tensor:
    """(cp, numel) of (batch, heads, chunk, dim) tensors -> (batch, heads, cp * chunk, dim)."""
    batch, heads, chunk, dim = shape
    return rows.reshape(cp, batch, heads, chunk, dim).permute(1, 2, 0, 3, 4).reshape(batch, heads, cp * chunk, dim)


def _to_ranks(full: torch.Tensor, cp: int) -> torch.Tensor:
    """(batch, heads, cp * chunk, dim) -> (cp, batch * heads * chunk * dim): each rank's keys' part, flat."""
    batch, heads, seq, dim = full.shape
    return full.reshape(batch, heads, cp, seq // cp, dim).permute(2, 0, 1, 3, 4).reshape(cp, -1)


def _sdpa(q, k_all, v_all, call: GatheredAttention) -> torch.Tensor:
    # The aten op, not F.scaled_dot_product_attention: below torch-function modes, so the mode that
    # routes the model's SDPA calls here (sdpa_calls.py) does not route this one back, in backward too.
    return torch.ops.aten.scaled_dot_product_attention(
        q, k_all, v_all, call.mask(q.device), 0.0, False, scale=call.scale, enable_gqa=call.enable_gqa
    )


class _GatheredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: GatheredAttention):
        k_all, v_all = _gather_kv(k, v, call, check=True)
        out = _sdpa(q, k_all, v_all, call)
        ctx.save_for_backward(q, k, v)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        call: GatheredAttention = ctx.call
        k_all, v_all = _gather_kv(k, v, call, check=False)
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q, k_all, v_all))
            out = _sdpa(q_, k_, v_, call)
            dq, dk_all, dv_all = torch.autograd.grad(out, (q_, k_, v_), grad_out)
        # Each key's gradient is a sum over every rank's queries: reduce-scattered to its owner, in fp32.
        parts = torch.cat([_to_ranks(dk_all, call.cp), _to_ranks(dv_all, call.cp)], dim=1).float()
        mine = parts.new_empty(parts.shape[1:])
        dist.reduce_scatter_single(mine, parts.reshape(-1), group=call.group)
        dk, dv = mine[: k.numel()].view(k.shape), mine[k.numel() :].view(v.shape)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None
