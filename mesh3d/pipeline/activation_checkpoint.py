"""Activation checkpointing (recomputing a forward for its backward; not mesh3d/checkpoint/'s files).

Three parts: the "selective" policy, blocks checkpointed one by one, and the runtime's choice of
which forwards are recomputed and where (`ActivationCheckpointing`, at the end).

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

Under "selective" the checkpoint takes the selective contexts (above): the block keeps its matmul
and attention results as well, and its recompute runs the rest only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from mesh3d.model.fused_head_loss import computing_fused_head

_aten = torch.ops.aten

# The expensive ops whose outputs are kept. A linear layer reaches the dispatcher as mm (no bias)
# or addmm (bias), a batched matmul as bmm; aten.linear is listed for backends that keep it whole.
# Attention is one fused op per backend (the CPU one included); _scaled_mm is the float8 matmul.
# Only these overloads: an out= variant (inductor calls its matmuls so, into buffers it owns) is
# recomputed, as a cached result could not be written into the caller's buffer.
SAVED_OPS: frozenset = frozenset(
    {
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
    }
)


def save_matmuls_and_attention(ctx: SelectiveCheckpointContext, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: keep what `SAVED_OPS` computes, recompute the rest (a fused head's
    chunks included: kept, they would be the whole logits it exists not to hold)."""
    if op in SAVED_OPS and not computing_fused_head():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


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
    contexts = selective_contexts if switch.mode == SELECTIVE else _plain_contexts
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_with_forward_modes(contexts), **kwargs)


def _plain_contexts() -> tuple:
    return contextlib.nullcontext(), contextlib.nullcontext()


def _with_forward_modes(contexts: Callable[[], tuple]) -> Callable[[], tuple]:
    """`contexts` with the torch-function modes active at the forward that ask for it
    (`reenter_on_recompute`) active again at the recompute.

    A block checkpointed on its own recomputes inside the backward, where the modes its stage call
    ran under are no longer entered: context parallelism's attention is one (its SDPA calls must
    attend over the whole sequence in the recompute as in the forward). Other modes (a default
    device, a user's) are left as torch's checkpoint leaves them."""

    def both() -> tuple:
        forward, recompute = contexts()
        modes = [m for m in _get_current_function_mode_stack() if getattr(m, "reenter_on_recompute", False)]
        return forward, _entered(recompute, modes)

    return both


@contextlib.contextmanager
def _entered(first: AbstractContextManager, modes: list) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(first)
        for mode in modes:
            stack.enter_context(mode)
        yield


@dataclass(frozen=True)
class ForwardChoice:
    """How one stage-microbatch forward keeps what its backward needs."""

    recompute: bool  # its activations are recomputed for its backward (not kept)
    per_block: bool  # by its blocks, each checkpointing itself (torch recomputes them inside B)
    before_backward: bool  # by the runtime, just before the backward, as a plain forward
    grad: bool  # whether the forward itself runs with grad enabled


class ActivationCheckpointing:
    """The runtime's activation checkpointing: which forwards it recomputes, and where.

    Args:
        mode: "never", "always", "except_last" (the last microbatch is kept) or "selective"
            (every microbatch keeps its matmul and attention outputs and recomputes the rest).
        stages: this rank's stage modules, by stage index.
        blocks: a stage's repeated blocks (the anatomy's `blocks`), checkpointed one by one;
            None: every stage is checkpointed whole.
        split_backward: whether the schedule splits backwards into I and W.
        microbatches: per step ("except_last" keeps the last of them).

    What it checkpoints:
    - schedules with a whole backward (gpipe, 1f1b, interleaved_1f1b): each block of a stage on
      its own (above), inside the block's FSDP/DDP unit; the stage's ends (embedding, head, loss)
      keep their activations. A block keeps its inputs ("selective": and its matmul and attention
      results), and torch recomputes it inside B's backward, one block at a time. A stage without
      blocks is checkpointed whole: recomputed by torch inside B ("always", "except_last"), or,
      under "selective", as under a split backward (below).
    - split-backward schedules (zero_bubble, zbv): the whole stage, recomputed by the runtime just
      before I as a plain forward whose graph serves I and W ("selective": with the cached
      results). torch's checkpoint recomputes once per backward pass, and I and W are two passes
      over one graph: per block, W would recompute every block again (and find a selective cache
      already spent).
    """

    def __init__(
        self,
        mode: str,
        stages: dict[int, nn.Module],
        blocks: Callable[[nn.Module], list[nn.Module]] | None,
        split_backward: bool,
        microbatches: int,
    ):
        self.mode = mode
        self.split_backward = split_backward
        self.microbatches = microbatches
        # The stages whose blocks checkpoint themselves, each while the switch is on (forward).
        self.block_switch = BlockCheckpointSwitch()
        self.per_block_stages: set[int] = set()
        if mode != "never" and blocks is not None and not split_backward:
            for index, stage_module in stages.items():
                stage_blocks = blocks(stage_module)
                if stage_blocks:
                    checkpoint_blocks(stage_blocks, self.block_switch)
                    self.per_block_stages.add(index)

    def choose(self, stage: int, mb: int, train: bool) -> ForwardChoice:
        """How the forward of `stage` on microbatch `mb` keeps what its backward needs."""
        mode, m = self.mode, self.microbatches
        recompute = train and (mode in ("always", "selective") or (mode == "except_last" and mb % m != m - 1))
        # Where the forward is recomputed: by torch's checkpoint inside B's backward pass (per
        # block, or the whole stage when it has no blocks), or by the runtime just before the
        # backward, as a plain forward building the graph the backward then walks: for a split
        # backward (I and W share that graph), and under "selective" for a stage without blocks
        # (see `forward`).
        per_block = recompute and stage in self.per_block_stages
        before_backward = recompute and not per_block and (self.split_backward or mode == "selective")
        # Under "selective" the forward runs with grad enabled, as its recompute will: a composite
        # op may pick its kernels by requires_grad, and the cache is read back by op and position.
        grad = train and (not before_backward or mode == "selective")
        return ForwardChoice(recompute, per_block, before_backward, grad)

    def forward(
        self, choice: ForwardChoice, call: Callable, *args
    ) -> tuple[object, AbstractContextManager | None, int]:
        """`call(*args)` as `choice` says: (its output, the selective cache its recompute before
        the backward reads back or None, how many block forwards ran under a checkpoint).

        The selective cache is that of a whole stage (a split backward's, or a stage without
        blocks): the policy's results are cached for the recompute before the backward, and the
        graph built here is dropped (the caller keeps no output with grad; torch's checkpoint runs
        this forward so that its hooks keep nothing but the cache, and its own recompute never
        runs). Why not keep this graph and let torch recompute the whole stage inside the backward:
        - the cache is read back by op and position, so the recompute must dispatch the forward's
          ops again. Inside a backward pass the hooks of the stage's FSDP units take other paths
          (a module's pre-forward is skipped once its pre-backward has run) and dispatch other ops
          (profiler ranges), which torch's selective checkpointing refuses (a block's checkpoint
          sits inside its FSDP unit, and sees none of them). Before the backward they run as in
          the forward.
        - a split backward's I and W are two passes over one graph; torch recomputes per pass and
          hands its selective cache out once, so W would find it spent.
        """
        if choice.per_block:
            before = self.block_switch.checkpointed
            with self.block_switch.on(SELECTIVE if self.mode == "selective" else FULL):
                out = call(*args)
            return out, None, self.block_switch.checkpointed - before
        if choice.recompute and self.mode == "selective":
            caching, cached = selective_contexts()
            out = checkpoint(call, *args, use_reentrant=False, context_fn=lambda: (caching, contextlib.nullcontext()))
            return out, cached, 0
        if choice.recompute and not choice.before_backward:
            return checkpoint(call, *args, use_reentrant=False), None, 0
        return call(*args), None, 0


def rng_state(device: torch.device) -> tuple:
    """The RNG as it is now, for a recompute to draw the same (dropout) masks."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def restored_rng(state: tuple, device: torch.device) -> Iterator[None]:
    """Run with the RNG as it was at `state` (dropout draws the same masks), then put it back."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield
