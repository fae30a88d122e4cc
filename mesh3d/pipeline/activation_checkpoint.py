"""Activation checkpointing (recomputing a forward for its backward; not mesh3d/checkpoint/'s files).

**Selective**: the policy of activation_checkpoint="selective", which results a stage keeps and
which it recomputes.

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

**Per block**: each of a stage's blocks is checkpointed on its own.

The runtime (runtime.py) turns a stage's blocks (the model's repeated blocks, as its anatomy names
them) into checkpointed blocks once, and switches them on for the forwards it checkpoints. Each
block's `forward` is replaced in place by one that runs the original under
`torch.utils.checkpoint.checkpoint(use_reentrant=False)` when the switch is on, so:

- a block keeps only its inputs for its backward, and torch recomputes it inside the backward pass,
  block by block: the recompute holds one block's activations at a time, not a whole stage's;
- parameter names stay those of the unsplit model (no wrapper module), as for compiled blocks
  (model/compiled_blocks.py), and whatever wraps a block from outside runs outside the
  checkpointed region: FSDP2/DDP's module hooks (data_parallel/wrap.py wraps every block) run
  once per forward and never inside the recompute. A compiled block is checkpointed around its
  compiled forward (the runtime patches after parallelize compiled it);
- the stage's ends (embedding, final norm and head, loss) are not checkpointed.

Under "selective" the checkpoint takes the selective contexts (above): the block keeps its matmul and attention results as well, and its recompute runs the rest only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

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


# What the switch holds while a forward runs: no checkpointing, torch's whole recompute, or selective.
OFF, FULL, SELECTIVE = None, "full", "selective"


class BlockCheckpointSwitch:
    """Whether the checkpointed blocks checkpoint the forward running now: off unless the runtime
    turns it on for one stage-microbatch forward (`on`), so an evaluation, a forward outside the
    runtime, or the last microbatch under "except_last" keeps its activations as without it.
    Read at forward time only: a recompute inside the backward is torch's and needs no switch."""

    def __init__(self):
        self.mode: str | None = OFF
        self.checkpointed = 0  # block forwards run under a checkpoint so far (the runtime's counter reads it)

    @contextlib.contextmanager
    def on(self, mode: str | None) -> Iterator[None]:
        """Checkpoint the blocks' forwards (FULL or SELECTIVE; OFF: none) inside this context."""
        previous, self.mode = self.mode, mode
        try:
            yield
        finally:
            self.mode = previous


def checkpoint_blocks(blocks: list[nn.Module], switch: BlockCheckpointSwitch) -> None:
    """Make each block's forward checkpoint itself whenever `switch` is on, in place."""
    for block in blocks:
        block.forward = functools.partial(_checkpointed_call, switch, block.forward)


def _checkpointed_call(switch: BlockCheckpointSwitch, forward: Callable, *args, **kwargs):
    if switch.mode is OFF:
        return forward(*args, **kwargs)
    switch.checkpointed += 1
    if switch.mode == SELECTIVE:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
