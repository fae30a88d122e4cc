"""Apply a tensor-parallel plan to one pipeline stage, and the loss-parallel context."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module, loss_parallel

from mesh3d.tensor.plan import resolve_plan


def apply_tensor_parallel(stage: nn.Module, plan: dict[str, ParallelStyle], tp_mesh: DeviceMesh) -> nn.Module:
    """Shard `stage` over `tp_mesh` with the modules of `plan` that the stage owns (others are skipped).

    Values are taken as they are on each rank, without communication (src_data_rank=None): the
    caller makes replicas identical first. Works on meta stages too (no memory, no messages).
    """
    owned = resolve_plan(stage, plan)
    if owned:
        parallelize_module(stage, tp_mesh, owned, src_data_rank=None)
    return stage


def loss_context(enabled: bool) -> Callable[[], AbstractContextManager]:
    """A factory of the context the last stage computes its loss and runs its backward in.

    With loss parallel the logits stay vocab-sharded DTensors and torch's `loss_parallel()` makes
    cross-entropy work on the shards; its backward must run inside the same context.
    """
    return loss_parallel if enabled else contextlib.nullcontext
