"""Attention over the whole sequence from a rank that holds a chunk of it: K and V all-gathered.

Llama 3's and torchtitan's choice among context-parallel attentions: each rank gathers every
rank's keys and values (one all-gather per layer, both at once), attends with its own queries
under the mask of their global positions, and in backward sums each key's and value's gradient
back to the rank that owns it (one reduce-scatter, in fp32). The gathered K and V are not kept
for backward: backward gathers them again and recomputes the attention, so besides its own chunk
a rank holds one layer's whole-sequence K and V at a time, forward and backward alike (the price:
the attention's forward runs twice, as under activation checkpointing).

A causal call (every call of a causal model without packed documents) attends each run of the
rank's queries at consecutive positions (its head chunk, its tail chunk) to the keys sorted by
position, up to its last query's: causal aligned at the lower right (lower_right_causal.py), which
a GPU's flash kernel takes whole, with no mask and no host sync.

Under another mask (documents) the keys are sorted by how many of the rank's queries see them and
the queries attend in row blocks, each to the keys up to the last one it sees (`_blocks`): a head
chunk's queries skip the keys after it, and no SDPA call takes a mask of more than MASK_PAIRS
(query, key) pairs. One call over every key would take (seq / cp) x seq of them, which SDPA turns
into a float mask (at seq 16,384 and cp = 4: 256 MiB, besides the 64 MiB bool mask sdpa_calls.py
builds once per call; docs/performance.md#long-sequences-context-parallelism). A causal call where
no fused kernel takes it (the CPU) is cut into row blocks of that size too. Attention sums over
keys, so their order changes nothing but the rounding; the mask follows each key's global
position. Without a mask the keys stay in gathered order (rank after rank) and one call attends
to them all.

Every rank of the group must call `attend` the same number of times in the same order (each
block's attention, microbatch by microbatch, as the schedule runs them): the collectives pair up
by order. Each call also carries the rank's verdict on the mask (sdpa_calls.py) inside the same
all-gather; the gathered verdicts stay on the device, summed over the step and judged by the next
call (call_verdicts.py), so a mask one rank cannot extend, or ranks calling differently, is refused
by every rank together, never a hang and never a host sync a call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mesh3d.context_parallel.lower_right_causal import fused_takes, lower_right_causal


@dataclass(frozen=True)
class CausalQueries:
    """A causal call's queries by position: runs (first query, stop, position of the first) of
    consecutive positions, and the gathered keys in position order (the gathered index of each;
    together the keys hold each position of the sequence once)."""

    runs: tuple[tuple[int, int, int], ...]
    key_order: torch.Tensor

    @staticmethod
    def of(query_positions: torch.Tensor, key_positions: torch.Tensor) -> CausalQueries:
        """From this rank's tokens' positions (host, in the order it holds them) and every gathered
        key's (on the device the keys will be on)."""
        positions = query_positions.cpu().numpy()  # host memory, read through numpy: no device waits
        breaks = [0, *(np.flatnonzero(positions[1:] != positions[:-1] + 1) + 1).tolist()]
        stops = [*breaks[1:], len(positions)]
        runs = tuple((a, b, int(positions[a])) for a, b in zip(breaks, stops, strict=True))
        return CausalQueries(runs, torch.argsort(key_positions))


@dataclass(frozen=True)
class GatheredAttention:
    """What an attention call needs besides q, k and v: the cp group, and how to build the mask of
    this rank's queries against every gathered key (None: no mask, every key seen)."""

    group: dist.ProcessGroup
    cp: int
    mask: Callable[[torch.device], torch.Tensor | None]
    scale: float | None
    enable_gqa: bool
    # this rank's verdict on the call (sdpa_calls.py), shared in the gather; `note` takes every rank's,
    # a (cp,) tensor on the device, unread (call_verdicts.py: judged by the next call)
    verdict: int
    note: Callable[[torch.Tensor], None]
    causal: CausalQueries | None = None  # a causal call: `mask` is not built, its runs are attended


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: GatheredAttention) -> torch.Tensor:
    """SDPA of this rank's queries (batch, heads, chunk, dim) over the whole sequence's keys and values."""
    return _GatheredAttention.apply(q, k, v, call)


# Each SDPA call under a mask takes at most this many (query, key) pairs of it: SDPA makes a
# boolean mask a float one of the same shape (4 bytes a pair), and on the CPU a masked call computes
# every pair, the masked ones too. 2**21 pairs: an 8 MiB float mask a call.
MASK_PAIRS = 2**21


@dataclass(frozen=True)
class _Blocks:
    """How one call's queries are attended under a mask: the keys in the order `order` (gathered
    index of each; None: as gathered, no mask), and row blocks (start, stop, keys): queries
    start..stop-1 attend to the first `keys` keys of that order, under `mask`'s rows and columns."""

    mask: torch.Tensor | None
    order: torch.Tensor | None
    rows: list[tuple[int, int, int]]
    causal: bool = False  # each row block causal at the lower right over its keys, no mask


def _blocks_of(call: GatheredAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> _Blocks:
    """How this call's queries attend: by causal runs, or under its mask (`_blocks`)."""
    if call.causal is None:
        return _blocks(call.mask(q.device), q.shape[-2], call.cp * k.shape[-2])
    whole = fused_takes(q, k, v, call.enable_gqa)
    rows = []
    for start, stop, first in call.causal.runs:
        step = stop - start if whole else max(1, MASK_PAIRS // (first + stop - start))
        rows += [(a, min(a + step, stop), first + min(a + step, stop) - start) for a in range(start, stop, step)]
    return _Blocks(None, call.causal.key_order, rows, causal=True)


def _blocks(mask: torch.Tensor | None, queries: int, keys: int) -> _Blocks:
    """The keys sorted by how many queries see them (most first): under a causal mask every query
    then sees a prefix of them (a key seen by a query is seen by every query that sees any later
    key), so a block of queries attends to the keys up to its last one seen and no further; under
    another mask (documents) a prefix still holds every key a block sees, the mask the rest."""
    if mask is None:
        return _Blocks(None, None, [(0, queries, keys)])
    seen = mask.flatten(0, 1)  # (batch or 1, queries, keys): which keys each query sees, per sequence
    seen = seen[0] if len(seen) == 1 else seen.any(dim=0)
    step = max(1, MASK_PAIRS // keys)
    spans = [(start, min(start + step, queries)) for start in range(0, queries, step)]
    counts = sum(seen[start:stop].sum(dim=0) for start, stop in spans)  # by span: bounded temporaries
    order = torch.argsort(counts, descending=True, stable=True)
    place = torch.empty_like(order)
    place[order] = torch.arange(keys, device=order.device)  # where each key stands in `order`
    # the last key each block sees, kept on the device until all are known: one host sync a call
    last = torch.stack([torch.where(seen[start:stop].any(dim=0), place, -1).max() for start, stop in spans])
    rows = [(start, stop, max(1, n + 1)) for (start, stop), n in zip(spans, last.tolist(), strict=True)]
    return _Blocks(mask, order, rows)  # a block seeing no key attends to the first, as SDPA says


def _gather_kv(k: torch.Tensor, v: torch.Tensor, call: GatheredAttention, check: bool, order) -> tuple:
    """Every rank's k and v along the sequence, in gathered order (rank after rank) or in `order`
    (and, where `check`, every rank's verdict on the call, noted unread)."""
    verdict = k.new_full((1,), float(call.verdict))
    flat = torch.cat([k.reshape(-1), v.reshape(-1), verdict])
    gathered = flat.new_empty(call.cp * flat.numel())
    dist.all_gather_single(gathered, flat, group=call.group)
    rows = gathered.view(call.cp, -1)
    if check:
        call.note(rows[:, -1])
    n = k.numel()
    k_all = _along_sequence(rows[:, :n], k.shape, call.cp, order)
    v_all = _along_sequence(rows[:, n : n + v.numel()], v.shape, call.cp, order)
    return k_all, v_all


def _by_rank(rows: torch.Tensor, shape: torch.Size, cp: int) -> torch.Tensor:
    """A view of (cp, numel) rows of (batch, heads, chunk, dim) tensors as (batch, heads, cp, chunk, dim)."""
    batch, heads, chunk, dim = shape
    return rows.view(cp, batch, heads, chunk, dim).permute(1, 2, 0, 3, 4)


def _along_sequence(rows: torch.Tensor, shape: torch.Size, cp: int, order) -> torch.Tensor:
    """(cp, numel) of (batch, heads, chunk, dim) tensors -> (batch, heads, cp * chunk, dim), the
    keys in gathered order or in `order` (one copy either way)."""
    batch, heads, chunk, dim = shape
    by_rank = _by_rank(rows, shape, cp)
    if order is None:
        return by_rank.reshape(batch, heads, cp * chunk, dim)
    return by_rank[:, :, order // chunk, order % chunk]


def _to_ranks(parts: torch.Tensor, shape: torch.Size, cp: int, order) -> Callable:
    """A function that adds the gradient of the first `keys` keys (batch, heads, keys, dim), in
    gathered order or in `order`, to `parts` (cp, batch * heads * chunk * dim): each rank's keys'
    part, flat."""
    chunk = shape[2]
    by_key = parts.view(cp, *shape).permute(0, 3, 1, 2, 4)  # (cp, chunk, batch, heads, dim)
    ranks, places = (None, None) if order is None else (order // chunk, order % chunk)

    def add(grad: torch.Tensor, keys: int) -> None:
        grad = grad.to(parts.dtype).permute(2, 0, 1, 3)  # (keys, batch, heads, dim)
        if ranks is None:  # no mask: one block, every key, in gathered order
            by_key.add_(grad.unflatten(0, (cp, chunk)))
        else:
            by_key.index_put_((ranks[:keys], places[:keys]), grad, accumulate=True)

    return add


def _sdpa(q, k_all, v_all, mask, call: GatheredAttention) -> torch.Tensor:
    # The aten op, not F.scaled_dot_product_attention: below torch-function modes, so the mode that
    # routes the model's SDPA calls here (sdpa_calls.py) does not route this one back, in backward too.
    return torch.ops.aten.scaled_dot_product_attention(
        q, k_all, v_all, mask, 0.0, False, scale=call.scale, enable_gqa=call.enable_gqa
    )


def _attend_block(q, k_all, v_all, mask, blocks: _Blocks, call: GatheredAttention) -> torch.Tensor:
    if blocks.causal:
        return lower_right_causal(q, k_all, v_all, call.scale, call.enable_gqa)
    return _sdpa(q, k_all, v_all, mask, call)


def _block(q, k_all, v_all, blocks: _Blocks, start: int, stop: int, keys: int):
    """Queries start..stop-1 and the keys and mask columns they attend to."""
    mask = blocks.mask
    if mask is not None:
        mask = mask[..., start:stop, :]
        if blocks.order is not None:
            mask = mask.index_select(-1, blocks.order[:keys])
    return q[..., start:stop, :], k_all[..., :keys, :], v_all[..., :keys, :], mask


def _block_gradients(q, k_all, v_all, grad_out, blocks: _Blocks, start, stop, keys, call: GatheredAttention):
    """The gradients of one block's queries and keys: its attention recomputed, then backward."""
    with torch.enable_grad():
        *tensors, mask = _block(q, k_all, v_all, blocks, start, stop, keys)
        q_, k_, v_ = (t.detach().requires_grad_(True) for t in tensors)
        out = _attend_block(q_, k_, v_, mask, blocks, call)
        return torch.autograd.grad(out, (q_, k_, v_), grad_out[..., start:stop, :])


class _GatheredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: GatheredAttention):
        blocks = _blocks_of(call, q, k, v)
        k_all, v_all = _gather_kv(k, v, call, True, blocks.order)
        out = torch.cat(
            [_attend_block(*_block(q, k_all, v_all, blocks, *r), blocks, call) for r in blocks.rows], dim=-2
        )
        ctx.save_for_backward(q, k, v)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        call: GatheredAttention = ctx.call
        blocks = _blocks_of(call, q, k, v)
        k_all, v_all = _gather_kv(k, v, call, False, blocks.order)
        # Each key's gradient is a sum over every rank's queries: summed here in fp32, each rank's
        # part in a row of `parts`, then reduce-scattered to its owner.
        parts = q.new_zeros((call.cp, k.numel() + v.numel()), dtype=torch.float32)
        add_k = _to_ranks(parts[:, : k.numel()], k.shape, call.cp, blocks.order)
        add_v = _to_ranks(parts[:, k.numel() :], v.shape, call.cp, blocks.order)
        dq = None if len(blocks.rows) == 1 else torch.empty_like(q)
        for start, stop, keys in blocks.rows:
            dq_, dk_, dv_ = _block_gradients(q, k_all, v_all, grad_out, blocks, start, stop, keys, call)
            if dq is None:
                dq = dq_
            else:
                dq[..., start:stop, :] = dq_
            add_k(dk_, keys)
            add_v(dv_, keys)
            del dq_, dk_, dv_
        mine = parts.new_empty(parts.shape[1:])
        dist.reduce_scatter_single(mine, parts.reshape(-1), group=call.group)
        dk, dv = mine[: k.numel()].view(k.shape), mine[k.numel() :].view(v.shape)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None
