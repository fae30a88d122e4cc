"""Stage-boundary shapes, known before the first message: every stage run on meta tensors, locally.

A receiver allocates its buffer from these shapes, so no rank ever asks a peer what it will send
(no pickled object exchange). The meta stages carry the tensor-parallel plan too, so the shapes are
the local shards' shapes, as sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

Spec = tuple[torch.Size, torch.dtype]


@dataclass(frozen=True)
class Boundaries:
    """What one microbatch shape produces at every stage boundary."""

    specs: list[Spec]  # shape and dtype of each stage's output (local shard), stage order
    output: torch.Tensor  # the model's output on meta (a DTensor under tensor parallelism)


class BoundaryShapes:
    """Runs every stage on meta tensors, once per microbatch shape and dtype."""

    def __init__(self, meta_stages: list[nn.Module]):
        self.meta_stages = meta_stages
        self._cache: dict[tuple, Boundaries] = {}

    def of(self, microbatch: torch.Tensor) -> Boundaries:
        key = (tuple(microbatch.shape), microbatch.dtype)
        if key not in self._cache:
            self._cache[key] = self._run(microbatch)
        return self._cache[key]

    @torch.no_grad()
    def _run(self, microbatch: torch.Tensor) -> Boundaries:
        x = torch.empty(microbatch.shape, dtype=microbatch.dtype, device="meta")
        last = len(self.meta_stages) - 1
        specs = []
        for index, stage in enumerate(self.meta_stages):
            x = stage(x)
            if not isinstance(x, torch.Tensor):
                raise TypeError(
                    f"pipeline stage {index} returned {type(x).__name__}; mesh3d sends exactly one "
                    "activation tensor between stages, so a stage's forward must return one tensor"
                )
            if isinstance(x, DTensor) and index < last:
                raise TypeError(
                    f"pipeline stage {index} returned a DTensor ({x.placements}); stages hand each other "
                    "plain local tensors, so the tp plan's last style in a stage must use use_local_output=True"
                )
            specs.append((x.to_local().shape if isinstance(x, DTensor) else x.shape, x.dtype))
        return Boundaries(specs, x)
