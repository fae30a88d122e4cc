"""Parameters a tp plan leaves replicated that compute on this rank's slice of an activation.

A plan shards the modules it names; every other module keeps plain, replicated parameters. Most of
them see whole activations (a norm between blocks) and get the whole gradient on every rank. But one
between a column-wise and a row-wise module (Apertus' xIELU activation, `act_fn.alpha_p`, between
`up_proj` and `down_proj`) sees only this rank's slice of the FFN: its forward is right, its
gradient is this rank's part of the sum. Nothing fails and the loss stays exact; only that parameter
drifts. So mesh3d finds such modules itself, whatever the plan names: it runs the meta stages before
and after the plan is applied and takes every module holding plain parameters whose inputs changed
shape. Every rank holds every stage on meta, so those two passes would be the same on each: the
first rank runs them and hands the names to the others (agree.from_first_rank). Their parameters
become Replicate DTensors on the tp mesh, used in the forward as local tensors whose gradient is a
Partial, summed over tp once per step with the plan's other partial gradients (gradients.py), as for
transformers' "replicated_with_grad_allreduce".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils._pytree import tree_leaves

from mesh3d.distributed.agree import from_first_rank


def modules_seeing_shards(stages: Iterable[nn.Module], shard: Callable[[], None], run: Callable[[], None]) -> list[str]:
    """The names of the modules holding plain trainable parameters whose inputs change shape when
    `shard()` applies the tp plan to `stages` (meta), as seen by `run()` running them: found on the
    first rank, `shard()` applied on every rank."""
    stages = list(stages)

    def find() -> list[str]:
        before = _input_shapes(stages, run)
        shard()
        after = _input_shapes(stages, run)
        return sorted(name for name in before if after.get(name, before[name]) != before[name])

    return from_first_rank(find, meanwhile=shard)


def _input_shapes(stages: list[nn.Module], run: Callable[[], None]) -> dict[str, list]:
    shapes: dict[str, list] = {}
    handles = []
    for stage in stages:
        for name, module in stage.named_modules():
            if any(_plain_trainable(p) for p in module._parameters.values()):

                def record(_module, args, kwargs, name=name):
                    leaves = tree_leaves((args, kwargs))
                    shapes.setdefault(name, []).append([tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)])

                handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return shapes


def _plain_trainable(param: nn.Parameter | None) -> bool:
    return param is not None and param.requires_grad and not isinstance(param, DTensor)


def replicate_on_shards(stages: Iterable[nn.Module], names: Iterable[str], tp_mesh: DeviceMesh) -> None:
    """Make the plain parameters of the modules `names` (those `stages` hold) Replicate DTensors on
    `tp_mesh` whose gradients come out Partial over tp. Values are kept as they are on each rank
    (replicas are made identical before), without communication; works on meta too."""
    names = set(names)
    for stage in stages:
        for name, module in stage.named_modules():
            if name in names:
                _replicate_module(module, tp_mesh)


def _replicate_module(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    own = [attr for attr, param in module._parameters.items() if _plain_trainable(param)]
    for attr in own:
        local = module._parameters[attr]
        module._parameters[attr] = nn.Parameter(DTensor.from_local(local.data, tp_mesh, [Replicate()], run_check=False))

    def local_views(module: nn.Module, _args) -> None:
        # An instance attribute is found before nn.Module's lookup of _parameters: the forward
        # computes with the local tensor, and autograd hands its gradient to the DTensor as a Partial.
        for attr in own:
            module.__dict__[attr] = module._parameters[attr].to_local(grad_placements=[Partial()])

    def drop_views(module: nn.Module, _args, _output) -> None:
        for attr in own:
            module.__dict__.pop(attr, None)

    module.register_forward_pre_hook(local_views)
    module.register_forward_hook(drop_views)
