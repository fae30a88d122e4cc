"""The anatomy of a traced model: any nn.Module torch.export captures, whose blocks sit in one
nn.Sequential / nn.ModuleList / nn.ModuleDict.

The blocks' container is the one that holds the split points, or, without split points, the
model's longest such container; the split then balances its children as `stage_balance` says,
like any other anatomy's blocks. Stages are cut by torch's pipeline frontend (capture.py), not by
copying the model and deleting blocks, so anything the forward computes between or around the
blocks lands in the stage that runs it, and tensors that skip stages are routed to their consumer.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from mesh3d.model.anatomy import Anatomy
from mesh3d.model.traced.capture import TracedModel

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def traced_anatomy(model: nn.Module, example_inputs: tuple | None, split_points: Sequence[str] | None) -> Anatomy:
    """The traced anatomy of `model`, captured once from `example_inputs` (torch's reason if it
    cannot be: a ValueError raised on every rank alike, before any collective)."""
    name = f"{type(model).__name__} (traced)"
    layers = _container(model, name, split_points)
    traced = TracedModel(model, example_inputs, name)
    traced.check_capturable()
    children = list(model._modules)
    first = last = ()
    if layers in children:  # a top-level container: what is registered around it weighs as the ends
        at = children.index(layers)
        first, last = tuple(children[:at]), tuple(children[at + 1 :])
    return Anatomy(
        name=name,
        layers=layers,
        first=first,
        last=last,
        tp_plan=getattr(model, "tp_plan", None),
        vocab_size=getattr(model, "vocab_size", None),
        traced=traced,
    )


def _container(model: nn.Module, name: str, split_points: Sequence[str] | None) -> str:
    """The dotted path of the blocks' container: the split points' parent, or the longest one."""
    containers = {path: m for path, m in model.named_modules() if isinstance(m, CONTAINERS) and len(m) > 0}
    if split_points:
        parents = {point.rpartition(".")[0] for point in split_points}
        if len(parents) != 1 or next(iter(parents)) not in containers:
            raise ValueError(
                f"{name}: split_points={list(split_points)} must name children of one nn.Sequential, nn.ModuleList "
                f"or nn.ModuleDict of the model (found {sorted(containers) or 'none'})"
            )
        return parents.pop()
    if not containers:
        raise ValueError(
            f"{name}: no nn.Sequential, nn.ModuleList or nn.ModuleDict to put stage boundaries between; hold the "
            "repeated blocks in one of them, or bring the model through the mesh3d protocol (docs/model_protocol.md)"
        )
    return max(containers, key=lambda path: len(containers[path]))  # the first of the longest
