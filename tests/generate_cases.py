"""Shared pieces of the generation tests: decisive weights and the full-forward greedy reference."""

from __future__ import annotations

import zlib

import torch
from torch import nn

# Larger than the init's 0.02: logits far apart, so the most likely token is decided by a margin
# much wider than fp32 rounding and two implementations must pick the same one.
STRONG_STD = 0.3


def strong_value(name: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A parameter's value by its name alone (norm gains 1), the same in every process."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)
    return torch.randn(shape, generator=generator) * STRONG_STD


@torch.no_grad()
def strengthen(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter of a plain model set to its strong_value (a tied weight once)."""
    for name, param in model.named_parameters():
        param.copy_(strong_value(name, tuple(param.shape), seed))
    return model


@torch.no_grad()
def full_forward_greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """The reference: the whole sequence through the training forward at every step, no cache."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]
