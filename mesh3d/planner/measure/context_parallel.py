"""What one context-parallel rank runs of a stage, for the probe (probe.py) to count on fake tensors.

Under cp a rank holds seq_len / cp tokens of every sequence and attends with their queries over
the whole sequence's keys and values (context_parallel/attention.py). The probe runs the stage on
the rank's tokens with each `F.scaled_dot_product_attention` call answered as that module answers
it, in shapes: the keys and values attended made whole-sequence long (the all-gather, whose values
do not matter on fake tensors), the attention run without a graph, only the rank's own q, k and v
kept for backward, and the backward running the attention forward again before its own. So the
meters count what a cp rank keeps and computes (the second forward's FLOPs included), and
`exchange` what it sends and holds, from the calls' own shapes: no head counts are assumed (a model
that repeats its K/V heads before SDPA gathers them repeated).

Under a mask (a causal call, or a boolean mask mesh3d extends) attention.py attends each query to
the keys up to its own position, sorted by position (documents: a prefix that holds them): over the
head and tail chunks of every rank (context_parallel/sequence_cut.py) (seq_len + 1) / 2 keys a
query on average, whatever the rank. The probe attends that many keys (document masks see fewer
pairs, within the same prefixes: charged as causal); unmasked, every key. A causal call builds no
mask (a GPU's flash kernel takes it whole, lower_right_causal.py), and the planner plans sequences
of one document: packed documents' mask rows (queries x sequence booleans a call) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import flop_counter

from mesh3d.planner.measure.costs import AttentionExchange
from mesh3d.planner.measure.meters import local_shard


@dataclass(frozen=True)
class AttentionCall:
    """One SDPA call on a cp rank: its local K and V and what it attends of the whole sequence."""

    kv_bytes: int  # this rank's K and V (compute dtype)
    kv_elements: int
    whole_kv_bytes: int  # the gathered K and V
    element_size: int
    kv_groups: int  # query heads per K/V head
    run_flops: float  # the attention forward, its rerun and its backward, over the keys the row blocks attend
    model_flops: float  # forward and backward over the whole score matrix (MFU's count, as at cp = 1)
    float_mask: bool  # an additive mask: mesh3d refuses it under cp


class GatheredAttentionShapes(TorchFunctionMode):
    """While active, SDPA calls run as a cp rank of `cp` runs them (see the module docstring);
    `calls` records each."""

    def __init__(self, cp: int):
        super().__init__()
        self.cp = cp
        self.calls: list[AttentionCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attend(*args, **kwargs)
        return func(*args, **kwargs)

    def _attend(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ) -> torch.Tensor:
        masked = is_causal or attn_mask is not None
        q, k, v = (local_shard(t) for t in (query, key, value))
        whole = self.cp * k.shape[-2]
        keys = (whole + 1) // 2 if masked else whole
        size = k.element_size()

        def flops(n: int) -> tuple[float, float]:  # (forward, backward) over n keys, as the probe counts them
            # per query head: grouped K/V heads (enable_gqa) are attended by each of their queries' heads
            kn, vn = (*q.shape[:-2], n, k.shape[-1]), (*q.shape[:-2], n, v.shape[-1])
            return flop_counter.sdpa_flop_count(q.shape, kn, vn), flop_counter.sdpa_backward_flop_count(
                q.shape, q.shape, kn, vn
            )

        (run_forward, run_backward), (forward, backward) = flops(keys), flops(whole)
        self.calls.append(
            AttentionCall(
                kv_bytes=(k.numel() + v.numel()) * size,
                kv_elements=k.numel() + v.numel(),
                whole_kv_bytes=self.cp * (k.numel() + v.numel()) * size,
                element_size=size,
                kv_groups=q.shape[-3] // k.shape[-3],
                run_flops=2 * run_forward + run_backward,
                model_flops=forward + backward,
                float_mask=attn_mask is not None and attn_mask.dtype != torch.bool,
            )
        )
        return _GatheredShapes.apply(query, key, value, keys, scale, enable_gqa)

    def exchange(self) -> AttentionExchange:
        """The calls recorded so far as one part's exchange (per sequence: the probe runs microbatches of one)."""
        calls, n = self.calls, self.cp
        if not calls:
            return AttentionExchange()
        largest = max(calls, key=lambda c: c.whole_kv_bytes)
        return AttentionExchange(
            calls=len(calls),
            gathered_bytes=sum((n - 1) * c.kv_bytes for c in calls),
            reduced_bytes=sum((n - 1) * c.kv_elements * 4 for c in calls),  # fp32: (cp-1)/cp of cp x local
            whole_kv_bytes=largest.whole_kv_bytes,
            element_size=largest.element_size,
            kv_groups=largest.kv_groups,
            run_flops=sum(c.run_flops for c in calls),
            model_flops=sum(c.model_flops for c in calls),
            float_masks=sum(c.float_mask for c in calls),
        )


def _attended(t: torch.Tensor, keys: int) -> torch.Tensor:
    """A (batch, heads, chunk, dim) tensor made `keys` long: the gathered keys a query attends."""
    return t.repeat(1, 1, -(-keys // t.shape[-2]), 1)[..., :keys, :]


class _GatheredShapes(torch.autograd.Function):
    """context_parallel/attention.py's _GatheredAttention in shapes, without its collectives."""

    @staticmethod
    def forward(ctx, q, k, v, keys, scale, enable_gqa):
        out = torch.ops.aten.scaled_dot_product_attention(
            q, _attended(k, keys), _attended(v, keys), None, 0.0, False, scale=scale, enable_gqa=enable_gqa
        )
        ctx.save_for_backward(q, k, v)
        ctx.args = (keys, scale, enable_gqa)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        keys, scale, enable_gqa = ctx.args
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q, _attended(k, keys), _attended(v, keys)))
            out = torch.ops.aten.scaled_dot_product_attention(
                q_, k_, v_, None, 0.0, False, scale=scale, enable_gqa=enable_gqa
            )
            dq, _, _ = torch.autograd.grad(out, (q_, k_, v_), grad_out)
        # each key's gradient comes back from the reduce-scatter: its values do not matter here
        return dq, torch.zeros_like(k), torch.zeros_like(v), None, None, None
