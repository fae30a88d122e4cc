"""Fresh, identical values for this rank's stages.

A model built on the meta device is sharded on meta (tensor and data parallelism), then each
rank allocates its shards (`to_empty`) and fills them with what the model's own initializer
(`init_weights()`, or each module's `reset_parameters()`) gives the whole model in one process:
`FullView` (full_view.py) shows it whole tensors one at a time. Ranks agree on the seed first,
so replicas are equal by construction. A model given with values keeps them; every rank of a
(dp, tp) replica group takes its group's first rank's values before sharding, one tensor at a
time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from mesh3d.mesh import Layout
from mesh3d.model.full_view import FullView


def to_device(stages: dict[int, nn.Module], device: torch.device) -> dict[int, nn.Module]:
    """Each stage of a model given with values moved to `device` (a model on meta is `allocate`d later)."""
    return {index: stage.to(device) for index, stage in stages.items()}


def allocate(stages: dict[int, nn.Module], device: torch.device) -> None:
    """`to_empty(device)` for every stage, keeping Parameters shared between modules (of one stage
    or of this rank's stages) shared: `to_empty` gives each module a fresh Parameter of its own
    where a plain tensor changes device."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for stage in stages.values():
        for module in stage.modules():
            for attr, param in module._parameters.items():
                if param is not None:
                    holders.setdefault(id(param), []).append((module, attr))
    for stage in stages.values():
        stage.to_empty(device=device)
    for shared in holders.values():
        (first, first_attr), *others = shared
        for module, attr in others:
            module._parameters[attr] = first._parameters[first_attr]


@torch.no_grad()
def initialize(
    stage: nn.Module,
    index: int,
    device: torch.device,
    seed: int | None = None,
    init_stage: Callable[[nn.Module, int], None] | None = None,
    base_seed: int | None = None,
) -> None:
    """Fresh values for a stage allocated from meta: the model's own init_weights() if it has one.

    The stage may be sharded already (DTensor parameters): the initializer runs inside
    `FullView`, so each shard gets the window of the values the whole tensor would get.

    With a `seed`, an `init_weights` that takes a `seed` argument gets it: a model that seeds each
    parameter by its name (as the LLaMA example does) then initializes the same model for one
    seed under every layout. The global RNG is reseeded too, with (seed + stage index), or
    without a seed with (initial seed + stage index), so stages on different ranks, which start
    from the same RNG state, do not get identical layers.

    `init_stage` (the anatomy's, e.g. a Hugging Face model's per-module seeded init) replaces
    init_weights: called with `seed`, or without one with the initial seed, the same on every rank
    that seeded alike. `base_seed` (from `agree_on_seed`) replaces the initial seed in both.
    """
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    if base_seed is None:
        base_seed = torch.initial_seed() if seed is None else seed
    with torch.random.fork_rng(devices=devices), FullView(stage):
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


def agree_on_seed(seed: int | None, device: torch.device) -> int:
    """The initialization seed every rank uses: `seed`, or global rank 0's initial seed (ranks
    seeded differently would otherwise fill the shards of one tensor from different draws)."""
    if seed is not None or not dist.is_initialized() or dist.get_world_size() == 1:
        return torch.initial_seed() if seed is None else seed
    value = torch.tensor([torch.initial_seed() % 2**63], dtype=torch.int64, device=device)
    dist.broadcast(value, src=0)
    return int(value.item())


@torch.no_grad()
def make_replicas_identical(stages: dict[int, nn.Module], layout: Layout) -> None:
    """Every rank of a (dp, cp, tp) replica group takes the values of the group's first rank.

    For a model given with values, before sharding: FSDP keeps each rank's own slice and TP takes
    values as they are, so ranks that built the model differently would otherwise train different
    models. One broadcast per tensor (never a flat copy of the stage), along tp, then cp, then dp.
    """
    for dim in ("tp", "cp", "dp"):
        if getattr(layout, dim) == 1:
            continue
        group, source = layout.group(dim), layout.group_ranks(dim)[0]
        for index in sorted(stages):
            tensors = {id(t): t for t in stages[index].state_dict(keep_vars=True).values()}
            for tensor in tensors.values():
                values = tensor.detach()
                staged = values if values.is_contiguous() else values.contiguous()
                dist.broadcast(staged, src=source, group=group)
                if staged is not values:
                    values.copy_(staged)
