"""The whole model's gradient norm over pp, dp and tp, each value counted once, and clipping by it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mesh3d.distributed.shards import local_tensor
from mesh3d.mesh import Layout


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float,
    layout: Layout,
    counted: Callable[[nn.Parameter], bool],
) -> torch.Tensor:
    """Scale this rank's gradients so the whole model's gradient norm is at most `max_norm`.

    `params` are this rank's; `counted(p)` says whether p's gradient enters the norm (a tied
    weight's other copies do not). Returns the norm before clipping, the same on every rank.
    """
    norm_type = float(norm_type)
    with_grad = [p for p in params if p.grad is not None]
    grads = [local_tensor(p.grad) for p in with_grad]
    norms = [(local_tensor(p.grad), _replicas(p.grad, layout)) for p in with_grad if counted(p)]
    device = layout.device
    if math.isinf(norm_type):
        local = max((g.abs().max().float() for g, _ in norms if g.numel()), default=torch.zeros((), device=device))
        op = dist.ReduceOp.MAX
    else:
        # A value held by r ranks enters the world-wide sum r times: each adds 1/r of it.
        local = sum((g.float().norm(norm_type) ** norm_type / r for g, r in norms), torch.zeros((), device=device))
        op = dist.ReduceOp.SUM
    total = local.clone()
    if layout.world_size > 1:
        dist.all_reduce(total, op=op)
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return total


def _replicas(tensor: torch.Tensor, layout: Layout) -> int:
    """How many ranks at this pp rank hold the same values as this rank's part of `tensor`:
    the sizes of the dp and tp axes it is not sharded over."""
    sharded = set()
    if isinstance(tensor, DTensor):
        names = tensor.device_mesh.mesh_dim_names or ()
        sharded = {name for name, placement in zip(names, tensor.placements) if not placement.is_replicate()}
    return math.prod(getattr(layout, dim) for dim in ("dp", "tp") if dim not in sharded)
