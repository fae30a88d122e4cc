"""Expert parallelism in `parallelize`: checked against the model, the tensor-parallel plan given way,
then each stage's experts split over the expert mesh's ep dim."""

from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import SequenceParallel

from mesh3d.expert_parallel.experts_style import split_experts
from mesh3d.expert_parallel.plan import ExpertPlan, check_expert_parallel
from mesh3d.mesh import Layout
from mesh3d.tensor.plan import TensorParallelConfig


def resolve_expert_parallel(
    plan: ExpertPlan | None, refusal: str, layout: Layout, tensor: TensorParallelConfig
) -> tuple[ExpertPlan | None, TensorParallelConfig]:
    """(the plan to apply, None at ep = 1; the tensor-parallel config without the experts modules,
    which hold whole experts under ep instead of every expert's slice). Raises ValueError, pure, on
    every rank alike."""
    check_expert_parallel(plan, refusal, layout.ep, splits_the_sequence(tensor))
    if layout.ep == 1:
        return None, tensor
    kept = {name: style for name, style in tensor.plan.items() if not plan.matches(name)}
    return plan, dataclasses.replace(tensor, plan=kept)


def splits_the_sequence(tensor: TensorParallelConfig) -> bool:
    """Whether the plan shards activations along the sequence (dim 1) between modules, so a tp group's
    ranks would hold different tokens: a SequenceParallel over it, or a style whose input or output
    layouts shard dim 1. Qwen3's per-head norms use SequenceParallel over dim 0 of their own heads'
    values only (model/hugging_face/tp_plan.py): not that."""
    for style in tensor.plan.values():
        if isinstance(style, SequenceParallel) and style.sequence_sharding[0].dim != 0:
            return True
        for attr in ("input_layouts", "output_layouts", "desired_input_layouts"):
            layouts = getattr(style, attr, None)
            layouts = layouts if isinstance(layouts, (tuple, list)) else (layouts,)
            if any(isinstance(layout, Shard) and layout.dim == 1 for layout in layouts):
                return True
    return False


def apply_expert_parallel(stages: dict[int, nn.Module], plan: ExpertPlan, layout: Layout) -> None:
    """Split every experts module of this rank's stages over the ep ranks (values taken as they are:
    the caller makes replicas identical first)."""
    tp_mesh = layout.mesh["tp"] if layout.tp > 1 else None
    for stage in stages.values():
        split_experts(stage, plan.matches, layout.expert_mesh, tp_mesh)
