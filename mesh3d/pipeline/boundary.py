"""Stage-boundary shapes, known before the first message: every stage run on meta tensors, locally.

A receiver allocates its buffer from these shapes, so no rank ever asks a peer what it will send
(no pickled object exchange). The meta stages carry the tensor-parallel plan too, so the shapes are
the local shards' shapes, as sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

Spec = tuple[torch.Size, torch.dtype]


@dataclass(frozen=True)
class Boundaries:
    """What one microbatch shape produces at every stage boundary."""

    specs: list[Spec]  # shape and dtype of each stage's output (local shard), stage order
    output: torch.Tensor  # the model's output on meta (a DTensor under tensor parallelism)


class BoundaryShapes:
    """Runs every stage on meta tensors, once per microbatch shape and dtype.

    `fake`: run under torch's FakeTensorMode, for a forward that reads values (transformers'
    packed-sequence check calls `.item()` on the position ids, which a meta tensor refuses and a
    fake tensor skips, as under tracing); the output is handed on as a plain meta tensor.
    """

    def __init__(self, meta_stages: list[nn.Module], fake: bool = False):
        self.meta_stages = meta_stages
        self.fake = fake
        self._cache: dict[tuple, Boundaries] = {}

    def of(self, microbatch: torch.Tensor) -> Boundaries:
        key = (tuple(microbatch.shape), microbatch.dtype)
        if key not in self._cache:
            self._cache[key] = self._run(microbatch)
        return self._cache[key]

    def _run(self, microbatch: torch.Tensor) -> Boundaries:
        if not self.fake:
            return self._run_stages(microbatch)
        with FakeTensorMode(allow_non_fake_inputs=True):
            boundaries = self._run_stages(microbatch)
        return Boundaries(boundaries.specs, _as_meta(boundaries.output))

    @torch.no_grad()
    def _run_stages(self, microbatch: torch.Tensor) -> Boundaries:
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


def _as_meta(fake: torch.Tensor) -> torch.Tensor:
    """A meta tensor (a DTensor with a meta shard) of the fake output's shape, dtype and placement."""
    if isinstance(fake, DTensor):
        local = torch.empty(fake.to_local().shape, dtype=fake.dtype, device="meta")
        return DTensor.from_local(local, fake.device_mesh, fake.placements, run_check=False, shape=fake.shape,
                                  stride=fake.stride())
    return torch.empty(fake.shape, dtype=fake.dtype, device="meta")
