"""An experts module split over the ep ranks: each holds E/ep experts whole and computes the tokens
sent to them.

`ExpertsSplit` is a torch ParallelStyle applied on the expert mesh's "ep" dim: the module's
parameters (all of them (experts, ...), plan.py checked) become DTensors sharded along the expert
dim, so checkpoints, the optimizer and FSDP see the global tensors, and the module's class becomes a
subclass whose forward sends each (token, expert) pair to the expert's rank (token_dispatch.py) and
runs the architecture's own experts forward there, on its local experts (ids 0 .. E/ep - 1, its
`num_experts` set to E/ep as transformers' own expert parallelism sets it).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from mesh3d.expert_parallel.token_dispatch import dispatch_to_experts


class ExpertsSplit(ParallelStyle):
    """Whole experts per ep rank, tokens dispatched all-to-all. `tp_mesh`: the ranks that hold the same
    tokens (tp > 1), each of which sends its own share of them; None without tp."""

    def __init__(self, tp_mesh: DeviceMesh | None):
        super().__init__()
        self.tp_mesh = tp_mesh

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tp={self.tp_mesh.size() if self.tp_mesh is not None else 1})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            # replicas are identical before any split (parallelize makes them so): each rank keeps its slice
            sharded = distribute_tensor(param.data, device_mesh, [Shard(0)], src_data_rank=None)
            module._parameters[name] = nn.Parameter(sharded, requires_grad=param.requires_grad)
        ep = device_mesh.size()
        module.num_experts = module.num_experts // ep
        module._mesh3d_dispatch = (device_mesh.get_group(), self.tp_mesh)
        module.__class__ = _split_class(type(module))
        return module


@functools.cache
def _split_class(original: type) -> type:
    return type(f"Split{original.__name__}", (original,), {"forward": _dispatched_forward, "_unsplit": original})


def _dispatched_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    ep_group, tp_mesh = self._mesh3d_dispatch
    with _local_parameters(self):
        return dispatch_to_experts(
            hidden_states,
            top_k_index,
            top_k_weights,
            functools.partial(self._unsplit.forward, self),
            self.num_experts,
            ep_group,
            tp_mesh,
            connect=lambda: sum(p.sum() for p in self.parameters()) * 0.0,
        )


@contextlib.contextmanager
def _local_parameters(module: nn.Module):
    """The module's DTensor parameters as this rank's shards while its own forward runs (`to_local`
    keeps them differentiable: each shard's gradient lands in the DTensor's)."""
    held = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
    try:
        for name, param in held.items():
            module._parameters[name] = param.to_local()
        yield
    finally:
        module._parameters.update(held)


def is_split_experts(module: nn.Module) -> bool:
    """Whether `module` is an experts module ExpertsSplit has split."""
    return hasattr(module, "_mesh3d_dispatch")


def split_experts(stage: nn.Module, patterns_match, expert_mesh: DeviceMesh, tp_mesh: DeviceMesh | None) -> int:
    """Split every experts module of `stage` whose unsplit name `patterns_match(name)`; returns how many."""
    style = ExpertsSplit(tp_mesh)
    split = 0
    for name, module in list(stage.named_modules()):
        if name and patterns_match(name) and not is_split_experts(module):
            style._apply(module, expert_mesh["ep"])
            split += 1
    return split
