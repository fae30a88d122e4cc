"""The policy of activation_checkpoint="selective": which results a stage keeps, which it recomputes.

A transformer's time goes to its matmuls and attention; the ops between them (norms, activations,
rotary embedding, residual adds, reshapes) are cheap to run again, yet their inputs and outputs
are most of what a block would keep for its backward. So "selective" keeps the results of
`SAVED_OPS` and recomputes everything else in the backward: it costs a small part of a forward
(not a whole one, as "always" does) and keeps a part of the activations (about the matmul outputs
of every block, not all of them, as "never" does).

The mechanism is torch's selective activation checkpointing
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`): a dispatch mode that, during the
forward, stores the outputs the policy marks MUST_SAVE, and during the recompute hands them back
instead of running the op again. The recompute runs the same kernels on the same inputs as the
forward, so the gradients are the ones without checkpointing, bit for bit.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

_aten = torch.ops.aten

# The expensive ops whose outputs are kept. A linear layer reaches the dispatcher as mm (no bias)
# or addmm (bias), a batched matmul as bmm; aten.linear is listed for backends that keep it whole.
# Attention is one fused op per backend (the CPU one included); _scaled_mm is the float8 matmul.
# Only these overloads: an out= variant (inductor calls its matmuls so, into buffers it owns) is
# recomputed, as a cached result could not be written into the caller's buffer.
SAVED_OPS: frozenset = frozenset({
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.linear.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_fused_attention_overrideable.default,
    _aten._scaled_mm.default,
})


def save_matmuls_and_attention(ctx: SelectiveCheckpointContext, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: keep what `SAVED_OPS` computes, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple:
    """A fresh (forward context, recompute context) pair for one checkpointed forward, as
    `torch.utils.checkpoint.checkpoint(..., context_fn=selective_contexts)` takes it: the first
    stores the kept outputs, the second hands them back, once."""
    return create_selective_checkpoint_contexts(save_matmuls_and_attention)
