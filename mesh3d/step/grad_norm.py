"""The whole model's gradient norm over pp, dp, cp, tp and ep, each value counted once, and clipping by it.

Foreach kernels (one per group of gradients of the same device, dtype and replica count, as
torch.nn.utils.clip_grad_norm_ groups them), one all-reduce, and no device-to-host read: the norm
and the clipping scale stay on the device."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mesh3d.axes import stage_size
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
    # Grouped by replica count, device and dtype, so that each group is one foreach kernel.
    groups: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for param in with_grad:
        grad = local_tensor(param.grad)
        if counted(param) and grad.numel():
            groups[(_replicas(param.grad, layout), grad.device, grad.dtype)].append(grad)
    local = torch.zeros((), device=layout.device)
    for (replicas, _, _), tensors in groups.items():
        norms = torch.stack(torch._foreach_norm(tensors, norm_type, dtype=torch.float32)).to(local.device)
        if math.isinf(norm_type):
            local = torch.maximum(local, norms.max())
        else:  # a value held by r ranks enters the world-wide sum r times: each adds 1/r of it
            local = local + (norms**norm_type).sum() / replicas
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    total = local.clone()
    if layout.world_size > 1:
        dist.all_reduce(total, op=op)
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # on the device: no host read
    for (_, dtype), tensors in _by_device_and_dtype(grads).items():
        torch._foreach_mul_(tensors, scale.to(device=tensors[0].device, dtype=dtype))
    return total


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups = defaultdict(list)
    for tensor in tensors:
        groups[(tensor.device, tensor.dtype)].append(tensor)
    return groups


def _replicas(tensor: torch.Tensor, layout: Layout) -> int:
    """How many ranks at this pp rank hold the same values as this rank's part of `tensor`: a
    stage's ranks (dp x cp x tp) over the shards of its mesh's dims that split it. Every mesh a
    parameter lives on spans ranks of one stage: dp (or dp x cp flattened), tp, HSDP's replicas
    and shards, the experts' edp and ep."""
    if not isinstance(tensor, DTensor):
        return stage_size(layout.sizes)
    sizes = dict(zip(tensor.device_mesh.mesh_dim_names or (), tensor.device_mesh.shape))
    split = [name for name, placement in zip(sizes, tensor.placements) if not placement.is_replicate()]
    return stage_size(layout.sizes) // math.prod(sizes[name] for name in split)
