"""Cutting one stage out of a model: a copy of the whole model with what the stage does not own removed.

Blocks outside the stage's range are deleted from their container (keys keep their numbers), the
first-stage end stays only on the first stage, the last-stage end only on the last (or an
nn.Identity stands in, where the model's forward calls the module regardless). Parameter names are
therefore exactly those of the unsplit model. The copy never duplicates what it drops: the deep
copy is told up front to map every unowned module to None (or to its stand-in).
"""

from __future__ import annotations

import copy

from torch import nn

from mesh3d.model.anatomy import Anatomy


def cut_stage(model: nn.Module, anatomy: Anatomy, stage: int, n_stages: int, layer_range: range) -> nn.Module:
    """Stage `stage` of `n_stages`: a copy of `model` holding only the blocks in `layer_range` (and
    the ends if first/last), on the model's device, made runnable by the anatomy."""
    container = anatomy.container(model)
    edges = [
        (container, key, anatomy.block_path(key)) for key in anatomy.block_names(model) if int(key) not in layer_range
    ]
    is_first, is_last = stage == 0, stage == n_stages - 1
    if not is_first:
        edges += [(_parent(model, path), path.rpartition(".")[2], path) for path in anatomy.first]
    if not is_last:
        edges += [(_parent(model, path), path.rpartition(".")[2], path) for path in anatomy.last]
    cut = {(id(parent), name) for parent, name, _ in edges}
    dropped = {id(parent._modules[name]): label for parent, name, label in edges if parent._modules[name] is not None}
    _check_not_shared(model, cut, dropped)
    memo: dict[int, object] = dict.fromkeys(dropped, None)
    for parent, name, label in edges:
        if label in anatomy.identity_when_dropped and parent._modules[name] is not None:
            memo[id(parent._modules[name])] = nn.Identity()
    stage_module = copy.deepcopy(model, memo)
    blocks = anatomy.container(stage_module)
    for key in [k for k, m in blocks._modules.items() if m is None]:
        del blocks._modules[key]
    if anatomy.make_stage is not None:
        stage_module = anatomy.make_stage(stage_module, is_first, is_last, layer_range)
    return stage_module


def _parent(model: nn.Module, path: str) -> nn.Module:
    parent = path.rpartition(".")[0]
    return model.get_submodule(parent) if parent else model


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


def block_parameter_counts(model: nn.Module, anatomy: Anatomy) -> tuple[list[int], int, int]:
    """Parameter counts per block and of the first/last ends (a tied head counts on both ends)."""

    def count(modules) -> int:
        return sum(p.numel() for m in modules if m is not None for p in m.parameters())

    first, last = anatomy.end_modules(model)
    return [count([block]) for block in anatomy.blocks(model)], count(first), count(last)
