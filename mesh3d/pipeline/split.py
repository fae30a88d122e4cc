"""The split: which blocks each stage gets (balanced, explicit counts, or split points), and the
stages themselves, each cut from the model as its anatomy says (model/cut.py): every stage on
meta, this rank's for real.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from mesh3d.model.anatomy import Anatomy
from mesh3d.model.cut import block_parameter_counts, cut_stage
from mesh3d.model.meta_copy import meta_copy
from mesh3d.model.traced.capture import TracedSplit

STAGE_BALANCE = ("layers", "params")


def assign_layers(
    n_layers: int,
    n_stages: int,
    *,
    layer_costs: Sequence[float] | None = None,
    first_cost: float = 0.0,
    last_cost: float = 0.0,
    layers_per_stage: Sequence[int] | None = None,
    ends_alone: tuple[bool, bool] = (False, False),
) -> list[range]:
    """Contiguous layer ranges, one per stage, each with at least one layer (but see `ends_alone`).

    Explicit `layers_per_stage` is taken as given; there the first and the last stage may hold no
    layer where `ends_alone` says the model has an end for them (the embedding alone, the output
    layer and loss alone: Megatron-LM's and the Llama 3 paper's balance). Otherwise the split
    minimizes the most expensive stage, where a stage costs the sum of its `layer_costs` (default 1
    each) plus `first_cost` on stage 0 and `last_cost` on the last stage (embedding and output
    head); among equally good splits, earlier stages take more layers.
    """
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        least = [1] * n_stages
        if n_stages > 1:
            least[0], least[-1] = (0 if alone else 1 for alone in ends_alone)
        if len(counts) != n_stages or sum(counts) != n_layers or any(c < m for c, m in zip(counts, least)):
            ends = [name for name, alone in zip(("first", "last"), ends_alone) if alone and n_stages > 1]
            allowed = f"; the {' and the '.join(ends)} may be 0 (a stage of its end alone)" if ends else ""
            if not ends and 0 in counts and n_stages > 1:
                allowed = " (a stage of an end alone needs a model whose anatomy names its ends: not a traced one)"
            raise ValueError(
                f"layers_per_stage={counts} must list {n_stages} counts (pp x virtual_stages) of at least one "
                f"layer each{allowed}, adding up to the model's {n_layers} layers"
            )
        starts = [sum(counts[:s]) for s in range(n_stages)]
        return [range(start, start + c) for start, c in zip(starts, counts)]
    if n_stages > n_layers:
        raise ValueError(
            f"cannot split {n_layers} layers into {n_stages} pipeline stages (pp x virtual_stages); every stage "
            f"needs at least one layer: lower pp or virtual_stages so that pp * virtual_stages <= {n_layers}"
            + (
                ", or give layers_per_stage with the first or last stage at 0 (its end alone)"
                if any(ends_alone) and n_stages <= n_layers + sum(ends_alone)
                else ""
            )
        )

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
    anatomy: Anatomy,
    n_stages: int,
    stage_balance: str = "layers",
    end_weight: float = 0.0,
    layers_per_stage: Sequence[int] | None = None,
) -> list[range]:
    """parallelize's stage split: explicit counts, or balanced by block count (the ends weighing
    `end_weight` blocks each) or by parameter count."""
    if stage_balance not in STAGE_BALANCE:
        raise ValueError(f"stage_balance={stage_balance!r}; choose one of {list(STAGE_BALANCE)}")
    n_layers = len(anatomy.block_names(model))
    # a stage of an end alone needs an end to hold (a traced model's stages come from its graph's cuts)
    ends_alone = (bool(anatomy.first), bool(anatomy.last)) if anatomy.traced is None else (False, False)
    if stage_balance == "params":
        per_layer, first, last = block_parameter_counts(model, anatomy)
        return assign_layers(
            n_layers,
            n_stages,
            layer_costs=per_layer,
            first_cost=first,
            last_cost=last,
            layers_per_stage=layers_per_stage,
            ends_alone=ends_alone,
        )
    return assign_layers(
        n_layers,
        n_stages,
        first_cost=end_weight,
        last_cost=end_weight,
        layers_per_stage=layers_per_stage,
        ends_alone=ends_alone,
    )


def split_point_counts(anatomy: Anatomy, blocks: list[str], split_points: Sequence[str]) -> list[int]:
    """Blocks per stage from the names where stages 1.. begin (PiPPy's SplitPoint.BEGINNING);
    `blocks`: the keys of the model's blocks, in order."""
    n_layers = len(blocks)
    names = {anatomy.block_path(key): i for i, key in enumerate(blocks)}
    starts = []
    for point in split_points:
        if point not in names:
            shown = list(names)[:4] + (["..."] if len(names) > 4 else [])
            raise ValueError(
                f"split_points: {point!r} is not a block of {anatomy.name}; a split point names the block a stage "
                f"begins with, one of {shown}"
            )
        starts.append(names[point])
    if starts != sorted(set(starts)) or (starts and starts[0] == 0):
        raise ValueError(
            f"split_points={list(split_points)} must name distinct blocks in model order, none the first block "
            "(stage 0 always begins there)"
        )
    bounds = [0, *starts, n_layers]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@dataclass
class Split:
    """A model cut into stages: all of them on meta (shapes, owners), this rank's for real."""

    from_meta: bool  # the model was given on meta: the real stages have no values yet
    meta_model: nn.Module  # the whole model on meta (the model itself when it was given on meta)
    meta_stages: list[nn.Module]  # every stage, stage order
    stages: dict[int, nn.Module]  # this rank's stages, on the model's device (meta: not materialized)


def split_model(
    model: nn.Module,
    anatomy: Anatomy,
    stage_layers: list[range],
    local_stages: list[int],
    traced: TracedSplit | None = None,
) -> Split:
    """Cut `model` into len(stage_layers) stages; build every stage on meta and `local_stages` from the model.
    A traced model's stages come from its capture (`traced`, cut at the same blocks)."""
    n_stages = len(stage_layers)
    on_meta = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    meta_model = model if on_meta else meta_copy(model)
    if traced is not None:
        meta_stages = [traced.stage(meta_model, s) for s in range(n_stages)]
        return Split(on_meta, meta_model, meta_stages, {s: traced.stage(model, s) for s in local_stages})
    meta_stages = [cut_stage(meta_model, anatomy, s, n_stages, stage_layers[s]) for s in range(n_stages)]
    stages = {s: cut_stage(model, anatomy, s, n_stages, stage_layers[s]) for s in local_stages}
    return Split(on_meta, meta_model, meta_stages, stages)


def named_stage_parameters(stages: dict[int, nn.Module]) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters of these stages, in stage order, under the unsplit model's names (a shared tensor once)."""
    seen: set[int] = set()
    for index in sorted(stages):
        for name, param in stages[index].named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield name, param
