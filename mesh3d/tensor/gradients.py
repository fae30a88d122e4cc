"""Tensor-parallel gradients laid out like their parameters after a step."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def settle_gradients(params: Iterable[nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements.

    Autograd leaves some tensor-parallel gradients pending or laid out differently from the
    parameter: a norm weight under sequence parallel gets Partial(sum) (one part per sequence
    shard), a vocab-sharded embedding a Replicate gradient. Redistributing sums the parts over
    tp and keeps each rank's own slice, so the optimizer, the tie all-reduce and the norm all
    see shards aligned with the parameters. (FSDP already does this in its reduce-scatter.)
    """
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)
