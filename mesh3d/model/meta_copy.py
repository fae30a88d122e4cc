"""A model copied onto the meta device: its structure and shapes, no data."""

from __future__ import annotations

import copy

import torch
from torch import nn


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
