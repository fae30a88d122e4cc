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

from mesh3d.pipeline.routes import MessageSpec, StageRoutes
from mesh3d.pipeline.shape_ops import ShapeRunOps


@dataclass(frozen=True)
class Boundaries:
    """What one microbatch shape produces at every stage boundary."""

    specs: dict[tuple[int, int], MessageSpec]  # by (producer, consumer) stage: what the message holds
    output: torch.Tensor  # the model's output on meta (a DTensor under tensor parallelism)


class BoundaryShapes:
    """Runs every stage on meta tensors, once per microbatch shape and dtype.

    `fake`: the forward may read values (transformers' packed-sequence check calls `.item()` on
    the position ids). The stages still run on meta first, several times cheaper, a scalar read
    answered there by shape_ops.py; only where that run raises do they run again under torch's
    FakeTensorMode (as under tracing, where transformers skips such checks), the output handed on
    as a plain meta tensor. Ops that a shape run cannot do as the real run does (grouped-mm
    experts' dtype rule, a data-dependent `nonzero`) take the shapes of shape_ops.py.
    """

    def __init__(
        self,
        meta_stages: list[nn.Module],
        fake: bool = False,
        routes: StageRoutes | None = None,
        takes: list[frozenset[str]] | None = None,
    ):
        self.meta_stages = meta_stages
        self.routes = routes if routes is not None else StageRoutes.chain(len(meta_stages))
        self.fake = fake
        self.takes = takes if takes is not None else [frozenset()] * len(meta_stages)  # per-sample inputs by stage
        self._cache: dict[tuple, Boundaries] = {}

    def of(self, microbatch: torch.Tensor, per_sample: dict[str, torch.Tensor] | None = None) -> Boundaries:
        """The boundaries of one microbatch of tokens and its per-sample inputs (as `of` slices them)."""
        per_sample = per_sample or {}
        key = (tuple(microbatch.shape), microbatch.dtype) + tuple(
            (name, tuple(t.shape), t.dtype) for name, t in sorted(per_sample.items())
        )
        if key not in self._cache:
            self._cache[key] = self._run(microbatch, per_sample)
        return self._cache[key]

    def _run(self, microbatch: torch.Tensor, per_sample: dict[str, torch.Tensor]) -> Boundaries:
        try:
            with ShapeRunOps():
                return self._run_stages(microbatch, per_sample)
        except Exception:
            if not self.fake:
                raise
        # Meta first: a fake run costs several times as much (measured 4-10x on tiny models).
        with FakeTensorMode(allow_non_fake_inputs=True), ShapeRunOps():
            boundaries = self._run_stages(microbatch, per_sample)
        return Boundaries(boundaries.specs, _as_meta(boundaries.output))

    @torch.no_grad()
    def _run_stages(self, microbatch: torch.Tensor, per_sample: dict[str, torch.Tensor]) -> Boundaries:
        routes, last = self.routes, len(self.meta_stages) - 1
        in_flight: dict[tuple[int, int], list[torch.Tensor]] = {}  # messages not yet consumed, as components
        specs: dict[tuple[int, int], MessageSpec] = {}
        out = torch.empty(microbatch.shape, dtype=microbatch.dtype, device="meta")
        on_meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in per_sample.items()}
        for index, stage in enumerate(self.meta_stages):
            extra = {name: t for name, t in on_meta.items() if name in self.takes[index]}
            if index == 0:
                out = stage(out, **extra)
            else:
                _check_joinable(index, [specs[(p, index)] for p in routes.producers(index)])
                out = stage(*[t for p in routes.producers(index) for t in in_flight.pop((p, index))], **extra)
            if index == last:
                if getattr(stage, "router_aux", None) is not None and isinstance(out, tuple) and len(out) == 2:
                    out = out[0]  # the output the loss takes; the routing sums beside it go to it too (router_aux.py)
                if not isinstance(out, torch.Tensor):
                    raise TypeError(
                        f"the last pipeline stage ({index}) returned {type(out).__name__}; the model's output, "
                        "which the loss takes, must be one tensor"
                    )
                break
            outputs = out if isinstance(out, tuple) else (out,)
            taken = {k for c in routes.consumers(index) for k in routes.takes[(index, c)]}
            if len(outputs) != len(taken) or not all(isinstance(t, torch.Tensor) for t in outputs):
                raise TypeError(
                    f"pipeline stage {index} returned {_describe(out)}, and its consumers take outputs "
                    f"{sorted(taken)}; a stage's forward must return one tensor, or the tuple of tensors its "
                    "routes send on"
                )
            for consumer in routes.consumers(index):
                components = [outputs[k] for k in routes.takes[(index, consumer)]]
                specs[(index, consumer)] = _message_spec(index, consumer, components)
                in_flight[(index, consumer)] = components
        return Boundaries(specs, out)


def _message_spec(producer: int, consumer: int, components: list[torch.Tensor]) -> MessageSpec:
    for t in components:
        if isinstance(t, DTensor):
            raise TypeError(
                f"pipeline stage {producer} returned a DTensor ({t.placements}); stages hand each other "
                "plain local tensors, so the tp plan's last style in a stage must use use_local_output=True"
            )
    spec = MessageSpec(tuple((t.shape, t.dtype) for t in components))
    dtypes = {dtype for _, dtype in spec.components}
    if len(components) > 1 and (len(dtypes) > 1 or not all(d.is_floating_point for d in dtypes)):
        raise TypeError(
            f"stage {producer} sends stage {consumer} {len(components)} tensors of dtypes "
            f"{[str(d) for _, d in spec.components]}; several tensors crossing one stage boundary travel "
            "together and must share one floating-point dtype (move the split point so that integer tensors "
            "stay inside a stage)"
        )
    return spec


def _check_joinable(stage: int, specs: list[MessageSpec]) -> None:
    """A stage's inputs from several producers are joined into one tensor for its backward."""
    dtypes = {spec.wire[1] for spec in specs}
    if len(specs) > 1 and (len(dtypes) > 1 or not all(d.is_floating_point for d in dtypes)):
        raise TypeError(
            f"stage {stage} receives messages of dtypes {sorted(map(str, dtypes))} from stages "
            "that skip to it; they must share one floating-point dtype"
        )


def _describe(out) -> str:
    if isinstance(out, tuple):
        return f"a tuple of {len(out)} ({', '.join(type(t).__name__ for t in out)})"
    return type(out).__name__


def _as_meta(fake: torch.Tensor) -> torch.Tensor:
    """A meta tensor (a DTensor with a meta shard) of the fake output's shape, dtype and placement."""
    if isinstance(fake, DTensor):
        local = torch.empty(fake.to_local().shape, dtype=fake.dtype, device="meta")
        return DTensor.from_local(
            local, fake.device_mesh, fake.placements, run_check=False, shape=fake.shape, stride=fake.stride()
        )
    return torch.empty(fake.shape, dtype=fake.dtype, device="meta")
