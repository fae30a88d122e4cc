"""Apply a tensor-parallel plan to pipeline stages, and the loss-parallel context."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from mesh3d.tensor.plan import resolve_plan


def apply_tensor_parallel(stages: Iterable[nn.Module], plan: dict[str, ParallelStyle], tp_mesh: DeviceMesh) -> None:
    """Shard each stage over `tp_mesh` with the modules of `plan` that the stage owns (others are skipped).

    Values are taken as they are on each rank, without communication (src_data_rank=None): the
    caller makes replicas identical first. Works on meta stages too (no memory, no messages).
    A Parameter that several module names (in one stage or across the given stages) shared before
    is shared again afterwards: parallelize_module gives each module a new Parameter of its own,
    which would silently untie a tied embedding and output head.
    """
    stages = list(stages)
    shared: dict[int, list[tuple[nn.Module, str]]] = {}  # id(old Parameter) -> every (module, attr) holding it
    for stage in stages:
        for module in stage.modules():
            for attr, param in module._parameters.items():
                if param is not None:
                    shared.setdefault(id(param), []).append((module, attr))
    for stage in stages:
        owned = resolve_plan(stage, plan)
        if owned:
            parallelize_module(stage, tp_mesh, owned, src_data_rank=None)
    for holders in shared.values():
        if len(holders) > 1:
            first_module, first_attr = holders[0]
            for module, attr in holders[1:]:
                setattr(module, attr, first_module._parameters[first_attr])


def loss_context(enabled: bool) -> Callable[[], AbstractContextManager]:
    """A factory of the context the last stage computes its loss and runs its backward in.

    With loss parallel the logits stay vocab-sharded DTensors and torch's `loss_parallel()` makes
    cross-entropy work on the shards; its backward must run inside the same context.
    """
    return loss_parallel if enabled else contextlib.nullcontext


def check_loss_parallel_output(placements: tuple | None, ndim: int) -> None:
    """Loss parallel needs the model output to stay a DTensor sharded on its last (vocab) dim."""
    last_dim_sharded = any(p.is_shard() and p.dim % ndim == ndim - 1 for p in placements or ())
    if not last_dim_sharded:
        raise ValueError(
            f"loss_parallel=True needs the model output to stay a vocab-sharded DTensor (Shard(-1)), but the tp plan "
            f"gives {placements or 'a plain tensor'}; shard the output head with "
            "ColwiseParallel(output_layouts=Shard(-1), use_local_output=False), e.g. llama_tp_plan(loss_parallel=True)"
        )
