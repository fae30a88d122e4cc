"""Fresh, identical values for this rank's stages before tensor and data parallelism shard them.

A model built on the meta device is materialized stage by stage on this rank's device and
initialized by its own `init_weights()` (or each module's `reset_parameters()`); a model given
with values keeps them. Either way every rank of a (dp, tp) replica group then takes the group's
first rank's values, so sharding starts from one model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from mesh3d.mesh import Layout


def to_device(stages: dict[int, nn.Module], device: torch.device, materialize: bool) -> dict[int, nn.Module]:
    """Each stage on `device`: allocated without values (from meta) or moved with its values."""
    return {index: stage.to_empty(device=device) if materialize else stage.to(device) for index, stage in stages.items()}


@torch.no_grad()
def initialize(
    stage: nn.Module, index: int, device: torch.device, seed: int | None = None,
    init_stage: Callable[[nn.Module, int], None] | None = None,
) -> None:
    """Fresh values for a stage materialized from meta: the model's own init_weights() if it has one.

    With a `seed`, an `init_weights` that takes a `seed` argument gets it: a model that seeds each
    parameter by its name (as the LLaMA example does) then initializes the same model for one
    seed under every layout. The global RNG is reseeded too, with (seed + stage index), or
    without a seed with (initial seed + stage index), so stages on different ranks, which start
    from the same RNG state, do not get identical layers.

    `init_stage` (the anatomy's, e.g. a Hugging Face model's per-module seeded init) replaces
    init_weights: called with `seed`, or without one with the initial seed, the same on every rank
    that seeded alike.
    """
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    base_seed = torch.initial_seed() if seed is None else seed
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(base_seed + index)
        if init_stage is not None:
            init_stage(stage, base_seed)
            return
        init_weights = getattr(stage, "init_weights", None)
        if callable(init_weights):
            if seed is not None and _takes_seed(init_weights):
                init_weights(seed=seed)
            else:
                init_weights()
            return
        for module in stage.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()


def _takes_seed(init_weights) -> bool:
    try:
        return "seed" in inspect.signature(init_weights).parameters
    except (TypeError, ValueError):  # a builtin or C function without a signature
        return False


@torch.no_grad()
def make_replicas_identical(stages: dict[int, nn.Module], layout: Layout) -> None:
    """Every rank of a (dp, tp) replica group takes the values of the group's first rank.

    Runs before sharding, on plain tensors, so that FSDP (which keeps each rank's own slice) and
    TP (which takes values as they are) start from one model even if ranks initialized differently.
    One flat broadcast per dtype per stage along tp, then along dp.
    """
    for dim in ("tp", "dp"):
        if getattr(layout, dim) == 1:
            continue
        group, source = layout.group(dim), layout.group_ranks(dim)[0]
        for index in sorted(stages):
            tensors = [t for t in stages[index].state_dict(keep_vars=True).values()]
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for tensor in {id(t): t for t in tensors}.values():
                by_dtype.setdefault(tensor.dtype, []).append(tensor)
            for same_dtype in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in same_dtype])
                dist.broadcast(flat, src=source, group=group)
                for tensor, values in zip(same_dtype, flat.split([t.numel() for t in same_dtype])):
                    tensor.detach().copy_(values.view_as(tensor))

