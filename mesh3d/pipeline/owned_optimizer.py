"""parallelize's `optimizer=`: a factory checked against the schedule (a never-drain schedule updates
inside the pipeline, stage by stage, so mesh3d must own the optimizer), then built over this rank's
stage parameters. What it builds is `pm.optimizer`; weight_versions.py steps it under never-drain."""

from __future__ import annotations

import torch
from torch import nn

from mesh3d.pipeline.config import PipelineConfig
from mesh3d.pipeline.split import named_stage_parameters


def check_optimizer(pipe: PipelineConfig, optimizer) -> None:
    """A never-drain schedule updates inside the pipeline: it needs the optimizer, and (for now) a
    split whose skip connections stay within a stage."""
    schedule = pipe.schedule.name
    if optimizer is not None and not callable(optimizer):
        raise ValueError(
            f"optimizer={optimizer!r} is not callable; pass a factory taking the parameters, e.g. "
            "functools.partial(torch.optim.AdamW, lr=3e-4)"
        )
    if pipe.never_drains and optimizer is None:
        raise ValueError(
            f"schedule {schedule!r} updates the weights inside the pipeline, stage by stage, so mesh3d must own the "
            "optimizer: pass optimizer=functools.partial(torch.optim.AdamW, lr=...) (any callable taking the "
            "parameters and returning a torch optimizer); it is then pm.optimizer"
        )
    if pipe.never_drains and pipe.routes.skips:
        raise ValueError(
            f"schedule {schedule!r} does not run a model with skip connections between stages yet (this split has "
            f"{list(pipe.routes.skips)}); use a schedule that drains, "
            "or split points that keep each skip within a stage"
        )


def build_optimizer(factory, stages: dict[int, nn.Module]) -> torch.optim.Optimizer:
    """The factory's optimizer over this rank's parameters (a shared tensor once)."""
    built = factory([param for _, param in named_stage_parameters(stages)])
    if not isinstance(built, torch.optim.Optimizer):
        raise ValueError(f"optimizer= returned {type(built).__name__}, not a torch.optim.Optimizer")
    return built
