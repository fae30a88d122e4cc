"""Stage builder: which layers each stage gets, and the stage modules themselves.

A stage is a copy of the whole model with what it does not own removed: layers outside its range
are deleted from the `layers` ModuleDict (keys keep their numbers), the modules registered before
`layers` stay only on the first stage, those after it only on the last. Parameter names are
therefore exactly those of the unsplit model. The copy never duplicates what it drops: the
deep copy is told up front to map every unowned module to None.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


STAGE_BALANCE = ("layers", "params")


def find_layers(model: nn.Module, attr: str = "layers") -> nn.ModuleDict:
    """The model's repeated blocks; a clear error if they are not an nn.ModuleDict keyed "0".."L-1"."""
    layers = getattr(model, attr, None)
    if not isinstance(layers, nn.ModuleDict):
        found = type(layers).__name__ if layers is not None else "nothing"
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleDict attribute {attr!r} (found {found}); mesh3d splits a model "
            f"by the repeated blocks it keeps in `self.{attr} = nn.ModuleDict({{'0': block, '1': block, ...}})` "
            "(see docs/model_protocol.md)"
        )
    expected = [str(i) for i in range(len(layers))]
    if list(layers.keys()) != expected:
        raise ValueError(f"{type(model).__name__}.{attr} must be keyed '0'..'{len(layers) - 1}' in order, got {list(layers.keys())}")
    if len(layers) == 0:
        raise ValueError(f"{type(model).__name__}.{attr} is empty; a pipeline needs at least one layer per stage")
    return layers


def end_modules(model: nn.Module, attr: str = "layers") -> tuple[list[str], list[str]]:
    """Names of the child modules registered before `layers` (first stage) and after it (last stage)."""
    names = list(model._modules)
    at = names.index(attr)
    return names[:at], names[at + 1 :]


def assign_layers(
    n_layers: int,
    n_stages: int,
    *,
    layer_costs: Sequence[float] | None = None,
    first_cost: float = 0.0,
    last_cost: float = 0.0,
    layers_per_stage: Sequence[int] | None = None,
) -> list[range]:
    """Contiguous layer ranges, one per stage, each with at least one layer.

    Explicit `layers_per_stage` is taken as given. Otherwise the split minimizes the most
    expensive stage, where a stage costs the sum of its `layer_costs` (default 1 each) plus
    `first_cost` on stage 0 and `last_cost` on the last stage (embedding and output head); among
    equally good splits, earlier stages take more layers.
    """
    if n_stages > n_layers:
        raise ValueError(
            f"cannot split {n_layers} layers into {n_stages} pipeline stages (pp x virtual_stages); every stage "
            f"needs at least one layer: lower pp or virtual_stages so that pp * virtual_stages <= {n_layers}"
        )
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != n_stages or sum(counts) != n_layers or any(c < 1 for c in counts):
            raise ValueError(
                f"layers_per_stage={counts} must list {n_stages} positive counts (pp x virtual_stages) "
                f"that add up to the model's {n_layers} layers"
            )
        starts = [sum(counts[:s]) for s in range(n_stages)]
        return [range(start, start + c) for start, c in zip(starts, counts)]

    costs = [1.0] * n_layers if layer_costs is None else [float(c) for c in layer_costs]
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, start: int, stop: int) -> float:
        extra = (first_cost if stage == 0 else 0.0) + (last_cost if stage == n_stages - 1 else 0.0)
        return prefix[stop] - prefix[start] + extra

    # best[s][i]: the least possible max stage cost for layers i.. split into stages s..
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[n_stages][n_layers] = 0.0
    for s in range(n_stages - 1, -1, -1):
        for i in range(n_layers - (n_stages - s), -1, -1):
            best[s][i] = min(
                max(cost(s, i, stop), best[s + 1][stop]) for stop in range(i + 1, n_layers - (n_stages - s - 1) + 1)
            )
    ranges, start = [], 0
    for s in range(n_stages):
        target = best[s][start]
        stops = range(n_layers - (n_stages - s - 1), start, -1)
        stop = next(e for e in stops if max(cost(s, start, e), best[s + 1][e]) <= target * (1 + 1e-12))
        ranges.append(range(start, stop))
        start = stop
    return ranges


def stage_layer_ranges(
    model: nn.Module,
    n_stages: int,
    stage_balance: str = "layers",
    end_weight: float = 0.0,
    layers_per_stage: Sequence[int] | None = None,
) -> list[range]:
    """parallelize's stage split: explicit counts, or balanced by layer count (the ends weighing
    `end_weight` layers each) or by parameter count."""
    if stage_balance not in STAGE_BALANCE:
        raise ValueError(f"stage_balance={stage_balance!r}; choose one of {list(STAGE_BALANCE)}")
    n_layers = len(find_layers(model))
    if stage_balance == "params":
        per_layer, first, last = layer_parameter_counts(model)
        return assign_layers(n_layers, n_stages, layer_costs=per_layer, first_cost=first, last_cost=last,
                             layers_per_stage=layers_per_stage)
    return assign_layers(n_layers, n_stages, first_cost=end_weight, last_cost=end_weight, layers_per_stage=layers_per_stage)


@dataclass
class Split:
    """A model cut into stages: all of them on meta (shapes, owners), this rank's for real."""

    from_meta: bool  # the model was given on meta: the real stages have no values yet
    meta_model: nn.Module  # the whole model on meta (the model itself when it was given on meta)
    meta_stages: list[nn.Module]  # every stage, stage order
    stages: dict[int, nn.Module]  # this rank's stages, on the model's device (meta: not materialized)


def split_model(model: nn.Module, stage_layers: list[range], local_stages: list[int]) -> Split:
    """Cut `model` into len(stage_layers) stages; build every stage on meta and `local_stages` from the model."""
    n_stages = len(stage_layers)
    on_meta = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    meta_model = model if on_meta else meta_copy(model)
    meta_stages = [build_stage(meta_model, s, n_stages, stage_layers[s]) for s in range(n_stages)]
    stages = {s: build_stage(model, s, n_stages, stage_layers[s]) for s in local_stages}
    return Split(on_meta, meta_model, meta_stages, stages)


def build_stage(model: nn.Module, stage: int, n_stages: int, layer_range: range, attr: str = "layers") -> nn.Module:
    """A copy of `model` holding only layer_range (and the ends if first/last), on the model's device."""
    before, after = end_modules(model, attr)
    layers = getattr(model, attr)
    edges = [(layers, key, f"{attr}.{key}") for key in layers.keys() if int(key) not in layer_range]
    if stage != 0:
        edges += [(model, name, name) for name in before]
    if stage != n_stages - 1:
        edges += [(model, name, name) for name in after]
    cut = {(id(parent), name) for parent, name, _ in edges}
    dropped = {id(parent._modules[name]): label for parent, name, label in edges if parent._modules[name] is not None}
    _check_not_shared(model, cut, dropped)
    memo = dict.fromkeys(dropped, None)
    stage_module = copy.deepcopy(model, memo)
    stage_layers = getattr(stage_module, attr)
    for key in [k for k, m in stage_layers._modules.items() if m is None]:
        del stage_layers._modules[key]
    return stage_module


def _check_not_shared(model: nn.Module, cut: set[tuple[int, str]], dropped: dict[int, str]) -> None:
    """A module this stage drops must not also be reachable through a part it keeps."""
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        path, module = stack.pop()
        for name, child in module._modules.items():
            if child is None or (id(module), name) in cut or id(child) in seen:
                continue
            where = f"{path}{name}"
            if id(child) in dropped:
                raise ValueError(
                    f"module {dropped[id(child)]!r} is also registered as {where!r}, and the two land on different "
                    "pipeline stages; share Parameters between stages (ties are supported), not whole modules"
                )
            seen.add(id(child))
            stack.append((where + ".", child))


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` on the meta device, sharing what the model shares, without copying any data."""
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for tensor in list(module._parameters.values()) + list(module._buffers.values()):
            if tensor is None or id(tensor) in memo:
                continue
            empty = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def layer_parameter_counts(model: nn.Module, attr: str = "layers") -> tuple[list[int], int, int]:
    """Parameter counts per layer and of the first/last ends (a tied head counts on both ends)."""
    before, after = end_modules(model, attr)

    def count(modules) -> int:
        return sum(p.numel() for m in modules if m is not None for p in m.parameters())

    layers = getattr(model, attr)
    per_layer = [count([layers[str(i)]]) for i in range(len(layers))]
    return per_layer, count(model._modules[n] for n in before), count(model._modules[n] for n in after)
