"""Data parallelism over the mesh's dp axis: FSDP2 or DDP per pipeline stage, synced once per step.

Both modes use torch's composable data-parallel APIs, applied per block and then to the stage
(the stage is the root): `fully_shard` (FSDP2) shards parameters, gradients and optimizer state
over dp; `replicate` (DDP built on the same machinery) keeps full replicas and all-reduces
gradients. Both expose `set_requires_gradient_sync`, so inside the pipeline schedule every
backward but the last of each stage only accumulates locally, and the last one reduces.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from mesh3d.mesh import Layout

DP_MODES = ("fsdp", "ddp")


def check_data_parallel_config(dp_mode: str, reshard_after_forward: bool | None) -> None:
    """Pure argument checks, the same on every rank."""
    if dp_mode not in DP_MODES:
        raise ValueError(f"dp_mode={dp_mode!r}; choose one of {list(DP_MODES)}")
    if dp_mode == "ddp" and reshard_after_forward is not None:
        raise ValueError(
            f"reshard_after_forward={reshard_after_forward} was given with dp_mode='ddp', which keeps full "
            "replicas and never reshards; drop reshard_after_forward or use dp_mode='fsdp'"
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward must be True, False or None, got {reshard_after_forward!r}")


@torch.no_grad()
def make_replicas_identical(stages: dict[int, nn.Module], layout: Layout) -> None:
    """Every rank of a (dp, tp) replica group takes the values of the group's first rank.

    Runs before sharding, on plain tensors, so that FSDP (which keeps each rank's own slice) and
    TP (which takes values as they are) start from one model even if ranks initialized differently.
    One flat broadcast per dtype per stage along tp, then along dp.
    """
    for dim in ("tp", "dp"):
        if getattr(layout, dim) == 1:
            continue
        group, source = layout.group(dim), layout.group_ranks(dim)[0]
        for index in sorted(stages):
            tensors = [t for t in stages[index].state_dict(keep_vars=True).values()]
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for tensor in {id(t): t for t in tensors}.values():
                by_dtype.setdefault(tensor.dtype, []).append(tensor)
            for same_dtype in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in same_dtype])
                dist.broadcast(flat, src=source, group=group)
                for tensor, values in zip(same_dtype, flat.split([t.numel() for t in same_dtype])):
                    tensor.detach().copy_(values.view_as(tensor))


def apply_data_parallel(
    stage: nn.Module, blocks: nn.ModuleDict, layout: Layout, dp_mode: str, reshard_after_forward: bool
) -> None:
    """Wrap each block of the stage, then the stage itself, for data parallelism over layout's dp dim."""
    _ignore_view_warning()
    mesh = layout.mesh["dp"]
    if dp_mode == "fsdp":
        wrap = functools.partial(fully_shard, mesh=mesh, reshard_after_forward=reshard_after_forward)
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        wrap = functools.partial(replicate, mesh=mesh)
    for block in blocks.values():
        wrap(block)
    wrap(stage)


@functools.cache
def _ignore_view_warning() -> None:
    # FSDP2 warns when a root returns a view, because an in-place op on it would skip a hook. The
    # pipeline runtime only detaches, sends and backpropagates stage outputs, never modifies them.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


class GradientSync:
    """Reduces each stage's gradients over dp once per step, on the stage's last backward.

    `before_backward` is the pipeline runtime's hook: the runtime knows which backward of a stage
    is its last in the step; every earlier one accumulates unreduced gradients (and, under FSDP,
    keeps parameters unsharded until the last one).
    """

    def __init__(self, stages: dict[int, nn.Module], reshard_between_backwards: bool = False):
        self.stages = stages
        self.reshard_between_backwards = reshard_between_backwards  # FSDP with reshard_after_forward=True
        self.synced_backwards = 0  # backwards that reduced gradients, over the life of the model

    def before_backward(self, stage: int, is_last: bool) -> None:
        module = self.stages[stage]
        module.set_is_last_backward(is_last)
        module.set_requires_gradient_sync(is_last)
        module.set_reshard_after_backward(is_last or self.reshard_between_backwards)
        self.synced_backwards += int(is_last)

    def end_forward_only(self) -> None:
        """After a forward-only pass (eval): reshard what the forwards gathered, so the optimizer's
        update of the shards is what the next forward gathers, and clear the per-iteration state
        that only a last backward would otherwise clear (torch's `reset_iter_state` on each root)."""
        for stage in self.stages.values():
            # A root that never ran a forward has nothing to reset, and torch's reset fails on it
            # (its lazy init has not run: the private `_is_root` is still None).
            if stage._get_fsdp_state()._is_root is not None:
                stage.reset_iter_state()

    def abort(self) -> None:
        """After a step raised: drop everything the failed step left inside FSDP/DDP.

        `reset_iter_state` (torch's recovery call on each root) waits for in-flight collectives,
        reshards and clears the per-iteration state, but keeps the unreduced gradients earlier
        backwards of the step accumulated on the unsharded parameters; the next step's last
        backward would reduce them too, and `zero_grad` does not reach them. They are cleared
        here through FSDP's internals (torch is pinned to 2.13 in pyproject.toml; tests/test_composition.py checks it).
        """
        self.end_forward_only()
        for stage in self.stages.values():
            for module in stage.modules():
                if not isinstance(module, FSDPModule):
                    continue
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    for fsdp_param in group.fsdp_params:
                        fsdp_param.unsharded_accumulated_grad = None
                        unsharded = getattr(fsdp_param, "_unsharded_param", None)
                        if unsharded is not None:
                            unsharded.grad = None
