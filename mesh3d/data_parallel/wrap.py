"""Wrapping each pipeline stage for data parallelism over the mesh's dp axis: FSDP2, HSDP or DDP.

Both modes use torch's composable data-parallel APIs, applied per block and then to the stage
(the stage is the root): `fully_shard` (FSDP2) shards parameters, gradients and optimizer state
over dp; `replicate` (DDP built on the same machinery) keeps full replicas and all-reduces
gradients. Both expose `set_requires_gradient_sync`, which gradient_sync.py uses to reduce once
per step. HSDP is `fully_shard` on a 2-D mesh (Layout.hybrid_data_mesh): shards within groups of
`dp_shard` dp ranks, replicas across them (the gradients reduce-scattered in a group, then
all-reduced between groups).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import fully_shard

from mesh3d.data_parallel.gradient_sync import GradientSync
from mesh3d.data_parallel.mixed_precision import MixedPrecision
from mesh3d.expert_parallel.experts_style import is_split_experts
from mesh3d.mesh import Layout

DP_MODES = ("fsdp", "hsdp", "ddp")
SHARDING_MODES = ("fsdp", "hsdp")  # parameters sharded (FSDP2's fully_shard), resharded after forward


@dataclass(frozen=True)
class DataParallelConfig:
    """How the dp axis wraps each stage, after the argument checks (see `resolve`)."""

    mode: str  # "fsdp", "hsdp" or "ddp"
    reshard_after_forward: bool  # FSDP/HSDP: free gathered parameters after each forward
    precision: MixedPrecision
    dp_shard: int | None = None  # HSDP: the dp ranks of a sharding group

    @classmethod
    def resolve(
        cls,
        dp_mode: str,
        reshard_after_forward: bool | None,
        pp: int,
        dp: int,
        precision: MixedPrecision,
        dp_shard: int | None = None,
        dp_axis: int | None = None,
    ) -> DataParallelConfig:
        """Check parallelize's dp arguments (pure, the same on every rank) and fill in the default:
        with pp > 1 microbatches reuse gathered parameters, so FSDP keeps them until the last
        backward; with dp = 1 (a wrap for mixed precision only) there is nothing to free. `dp`:
        the ranks holding the same parameters (dp x cp); `dp_axis`: the mesh's dp alone, which
        HSDP's `dp_shard` divides (default `dp`)."""
        if dp_mode not in DP_MODES:
            raise ValueError(f"dp_mode={dp_mode!r}; choose one of {list(DP_MODES)}")
        _check_dp_shard(dp_mode, dp_shard, dp if dp_axis is None else dp_axis)
        if dp_mode == "ddp" and reshard_after_forward is not None:
            raise ValueError(
                f"reshard_after_forward={reshard_after_forward} was given with dp_mode='ddp', which keeps full "
                "replicas and never reshards; drop reshard_after_forward or use dp_mode='fsdp'"
            )
        if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be True, False or None, got {reshard_after_forward!r}")
        default = pp == 1 and dp > 1
        reshard = default if reshard_after_forward is None else reshard_after_forward
        return cls(dp_mode, reshard, precision, dp_shard if dp_mode == "hsdp" else None)

    def wraps(self, dp: int) -> bool:
        """Whether stages are wrapped at all: for data parallelism, or for mixed precision alone."""
        return dp > 1 or self.precision.enabled

    def __str__(self) -> str:
        shard = f" dp_shard={self.dp_shard}" if self.dp_shard else ""
        return f"dp_mode={self.mode}{shard} reshard={self.reshard_after_forward} {self.precision}"


def _check_dp_shard(dp_mode: str, dp_shard: int | None, dp: int) -> None:
    if dp_mode != "hsdp":
        if dp_shard is not None:
            raise ValueError(
                f"dp_shard={dp_shard} was given with dp_mode={dp_mode!r}; it sizes HSDP's sharding groups: "
                "use dp_mode='hsdp', or drop dp_shard"
            )
        return
    if isinstance(dp_shard, bool) or not isinstance(dp_shard, int) or dp_shard < 1 or dp % dp_shard:
        divisors = [k for k in range(1, dp + 1) if dp % k == 0]
        raise ValueError(
            f"dp_mode='hsdp' needs dp_shard, the dp ranks that shard the parameters among them, dividing dp={dp}; "
            f"got dp_shard={dp_shard!r}. Choose one of {divisors} (the GPUs of a node, typically)"
        )


def apply_data_parallel(
    stages: dict[int, nn.Module],
    layout: Layout,
    config: DataParallelConfig,
    blocks: Callable[[nn.Module], list[nn.Module]],
) -> GradientSync:
    """Wrap each block of every stage (`blocks(stage)`, the model's repeated blocks), then the stage
    itself, over layout's dp dim (of any size, 1 included: the mixed-precision policy applies all
    the same); returns the once-per-step
    gradient sync the pipeline runtime calls before each backward.

    Each stage becomes its own FSDP/DDP root, so no Parameter may be shared by two stages
    (tied copies must be separated first).
    """
    _ignore_view_warning()
    mesh = layout.data_mesh  # dp, or dp x cp flattened: context-parallel ranks hold the same parameters
    if config.mode == "hsdp":
        mesh = layout.hybrid_data_mesh(config.dp_shard)  # (replicas, shards): each group with its cp ranks
    if config.mode in SHARDING_MODES:
        wrap = functools.partial(fully_shard, mesh=mesh, reshard_after_forward=config.reshard_after_forward)
    else:
        # A private import, on purpose: no public torch API (2.13) gives DDP with what the rest of
        # mesh3d uses. This `replicate` is FSDP2's machinery without sharding, so DDP gets the same
        # MixedPrecisionPolicy, set_requires_gradient_sync / set_is_last_backward, the state that
        # GradientSync.after_weight_backward finishes after a split backward's W, and
        # reset_iter_state after a failed step. torch.nn.parallel.DistributedDataParallel has none
        # of these (no_sync() only, no public mixed-precision policy) and takes tp's DTensor
        # parameters only after the private `_pre_dp_module_transform`; the public fully_shard(...,
        # dp_mesh_dims=DataParallelMeshDims(replicate="dp")) refuses plain parameters ("must be
        # DTensors on the full SPMD mesh"), and mesh3d's are plain (tp = 1) or DTensors on the tp
        # mesh. The DDP parity cases in tests/distributed/test_composition_parity.py fail if this
        # import moves or changes.
        from torch.distributed._composable.replicate_with_fsdp import replicate

        wrap = functools.partial(replicate, mesh=mesh)
    for stage in stages.values():
        _wrap_split_experts(stage, layout, config)
        for block in blocks(stage):
            wrap(block, mp_policy=config.precision.policy(root=False))
        wrap(stage, mp_policy=config.precision.policy(root=True))
    return GradientSync(
        stages, reshard_between_backwards=config.mode in SHARDING_MODES and config.reshard_after_forward
    )


def _wrap_split_experts(stage: nn.Module, layout: Layout, config: DataParallelConfig) -> None:
    """Each experts module split over ep (expert_parallel/) sharded (or replicated) over the ranks that
    hold the same experts, the expert mesh's edp dim. Each of those ranks computed its experts on the
    tokens of a whole ep group, every token once, so the gradient wanted is their sum divided as the
    rest of the model's is, by dp x cp (data parallelism's average), not by edp."""
    if layout.ep == 1:
        return
    mesh = layout.expert_mesh["edp"]
    policy = config.precision.policy(root=False)
    for module in stage.modules():
        if not is_split_experts(module):
            continue
        if config.mode in SHARDING_MODES:  # under HSDP too: the experts' own replicas are few
            fully_shard(module, mesh=mesh, reshard_after_forward=config.reshard_after_forward, mp_policy=policy)
        else:
            from torch.distributed._composable.replicate_with_fsdp import replicate  # see apply_data_parallel

            replicate(module, mesh=mesh, mp_policy=policy)
        module.set_gradient_divide_factor(float(layout.data_parallel_size))
        if config.mode in SHARDING_MODES and mesh.size() > 1 and "nccl" not in layout.backend:
            # gloo has no PREMUL_SUM, which FSDP's reduce-scatter would use for this factor: sum, then
            # divide. Not for DDP, whose one-rank reduce-scatter divides already (forcing sums there
            # would divide a second time after the all-reduce, torch 2.13), nor on one rank.
            module.set_force_sum_reduction_for_comms(True)


@functools.cache
def _ignore_view_warning() -> None:
    # FSDP2 warns when a root returns a view, because an in-place op on it would skip a hook. The
    # pipeline runtime only detaches, sends and backpropagates stage outputs, never modifies them.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
