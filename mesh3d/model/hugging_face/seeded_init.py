"""Initializing a Hugging Face model given on the meta device, one stage at a time, layout-independent.

transformers initializes a model by calling its `_init_weights(module)` on every module (the
nearest enclosing PreTrainedModel's, for composite models), drawing from the global RNG in module
order, so the values depend on which modules came before: a stage initialized alone would not
get what the unsplit model gets. mesh3d calls the same `_init_weights` per module, but reseeds the
RNG before each module from the seed and the module's name in the unsplit model (stages keep those
names), so a module gets the same values whichever stage, rank or layout holds it.

A tied output head (transformers' `_tied_weights_keys`: lm_head.weight -> model.embed_tokens.weight)
is not initialized on its own: as in transformers, the shared weight takes its source module's
init (the embedding's, padding row zeroed), and mesh3d copies it to every other copy
(pipeline/tied.py). Buffers that are not saved (the rotary `inv_freq`) have no values after
`to_empty`; `_init_weights` recomputes them from the config, as it does for transformers' own
meta-device loading.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn


@torch.no_grad()
def init_stage_weights(stage: nn.Module, seed: int) -> None:
    """Initialize every parameter and buffer `stage` (a Hugging Face causal LM or a stage cut from one) holds."""
    from transformers import PreTrainedModel, initialization

    tied_copies = set(stage.get_expanded_tied_weights_keys(all_submodels=True))
    for tensor in [*stage.parameters(), *stage.buffers()]:
        if hasattr(tensor, "_is_hf_initialized"):
            del tensor._is_hf_initialized  # set on meta (e.g. marking a tie); these are fresh, empty values now
    with initialization.guard_torch_init_functions():
        for name, module, owner in _modules_with_owner(stage, PreTrainedModel):
            own = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]
            has_buffers = any(b is not None for b in module._buffers.values())
            if not own and not has_buffers:
                continue
            if own and all(p in tied_copies for p in own):
                continue  # a tied copy: it takes its source's values
            torch.manual_seed(_seed_for(seed, name))
            owner._init_weights(module)


def _modules_with_owner(root: nn.Module, pretrained: type):
    """(name, module, the nearest PreTrainedModel at or above it), every module, parents first."""
    stack = [("", root, root)]
    while stack:
        name, module, owner = stack.pop()
        owner = module if isinstance(module, pretrained) else owner
        yield name, module, owner
        children = [(f"{name}.{n}" if name else n, child) for n, child in module._modules.items() if child is not None]
        stack.extend((n, child, owner) for n, child in reversed(children))


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
