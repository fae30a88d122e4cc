"""torch.compile per block (the model's repeated blocks, as its anatomy names them), the pattern torchtitan uses.

Each block's `forward` is replaced by its compiled version, so parameter names stay those of the
unsplit model (no `_orig_mod.` prefix in the state map, checkpoints or exports), and everything
that wraps a block from outside runs eagerly around the compiled region: FSDP2/DDP's hooks (the
block is wrapped after compiling), activation checkpointing (the runtime checkpoints each compiled
block, or a whole stage under a split backward, and replays the compiled blocks), the pipeline's
split backward. Tensor-parallel hooks of the block's own submodules are inside it and are traced
with it. Identical blocks share one compiled
graph: parameters are graph inputs, not constants.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

# Private on purpose: torch has no public switch for AOTAutograd's buffer donation (torch.compile's
# `options=` reach the inductor backend's config only), and a split backward needs it off.
import torch._functorch.config
from torch import nn

from mesh3d.model.anatomy import Anatomy

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def resolve_compile(compile: bool | str) -> str | None:
    """The torch.compile backend for parallelize's `compile=` argument: True means inductor, a
    string names a backend (e.g. "aot_eager": tracing and autograd without code generation, quick
    to build; for tests and debugging); False means eager."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return "inductor"
    if isinstance(compile, str) and compile in COMPILE_BACKENDS:
        return compile
    raise ValueError(f"compile={compile!r}; pass True (inductor), False, or one of {list(COMPILE_BACKENDS)}")


def compile_blocks(stages: Iterable[nn.Module], anatomy: Anatomy, backend: str, split_backward: bool = False) -> None:
    """Compile the forward of every block in each stage, in place.

    split_backward: the schedule runs each backward in two passes over one graph (I, then W with
    the graph kept). AOTAutograd's compiled backward reuses ("donates") buffers, which forbids a
    second pass, so donation is turned off (`torch._functorch.config.donated_buffer`, process-wide:
    it costs some memory in every compiled backward of this process).
    """
    if split_backward:
        torch._functorch.config.donated_buffer = False
    for stage in stages:
        for block in anatomy.blocks(stage):
            block.forward = functools.partial(_unaliased_call, torch.compile(block.forward, backend=backend))


def _unaliased_call(compiled, *args, **kwargs):
    # An input that is a view of another tensor (a tensor-parallel embedding's `to_local()` is a
    # view of the DTensor's shard) makes AOTAutograd send its gradient to the view's base, past the
    # DTensor's own backward: wrong gradients, or a crash in DTensor's redistribute. A copy breaks
    # the alias; it happens at most once per stage (a compiled block's outputs are not views).
    args = tuple(a.clone() if isinstance(a, torch.Tensor) and a.requires_grad and a._is_view() else a for a in args)
    return compiled(*args, **kwargs)
