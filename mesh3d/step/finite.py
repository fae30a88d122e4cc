"""Which of a set of tensors first holds a NaN or an Inf: one check per tensor, one host sync in all."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mesh3d.distributed.shards import local_tensor


@torch.no_grad()
def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor (this rank's shard of it) holding a NaN or an Inf, or None."""
    named = [(name, local_tensor(t)) for name, t in named]
    named = [(name, t) for name, t in named if t.is_floating_point() and t.numel()]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist()  # one sync, not one per tensor
    return next((name for (name, _), ok in zip(named, finite) if not ok), None)
