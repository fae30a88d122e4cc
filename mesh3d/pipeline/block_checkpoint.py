"""Activation checkpointing per block: each of a stage's blocks is checkpointed on its own.

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

Under "selective" the checkpoint takes torch's selective contexts (selective_checkpoint.py): the
block keeps its matmul and attention results as well, and its recompute runs the rest only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

from torch import nn
from torch.utils.checkpoint import checkpoint

from mesh3d.pipeline.selective_checkpoint import selective_contexts

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
