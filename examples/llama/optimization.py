"""train.py's optimizer and its learning-rate schedule: AdamW (matrices decay, norm gains do not),
linear warmup then cosine decay."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup from peak/warmup to peak, then cosine decay to min_ratio*peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_optimizer(params: list[torch.nn.Parameter], args) -> torch.optim.AdamW:
    """AdamW over this rank's parameters; matrices decay, norm gains (1-D) do not. A never-drain
    schedule gets it as parallelize's `optimizer=` factory (it steps inside the pipeline)."""
    params = list(params)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
