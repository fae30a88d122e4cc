"""parallelize's pipeline arguments, checked and resolved before anything is built.

Pure arithmetic on sizes and the (meta) model, so every rank raises the same error before any
collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from mesh3d.pipeline.schedule.catalog import SCHEDULES, build_schedule, check_schedule_config
from mesh3d.pipeline.schedule.ir import Schedule
from mesh3d.pipeline.split import find_layers, stage_layer_ranges

ACTIVATION_CHECKPOINT_MODES = ("never", "always", "except_last")


@dataclass(frozen=True)
class PipelineConfig:
    """The schedule (compute IR), the layers of every stage, and the activation checkpointing mode."""

    schedule: Schedule
    stage_layers: list[range]
    activation_checkpoint: str

    @classmethod
    def resolve(
        cls,
        model: nn.Module,
        pp: int,
        *,
        schedule: str,
        microbatches: int | None,
        virtual_stages: int | None,
        activation_checkpoint: str,
        layers_per_stage: Sequence[int] | None,
        stage_balance: str,
        end_weight: float,
    ) -> PipelineConfig:
        """Defaults: microbatches = pp; virtual_stages = 1 for zero_bubble (ZB-H1), 2 for zbv, and for
        interleaved_1f1b 2 when the model has at least 2*pp layers, else 1."""
        layers = find_layers(model)
        if microbatches is None:
            microbatches = pp
        if virtual_stages is None:
            spec = SCHEDULES.get(schedule)
            if spec is not None and spec.default_virtual_stages is not None:
                virtual_stages = spec.default_virtual_stages
            else:
                virtual_stages = 2 if spec is not None and spec.multi_stage and len(layers) >= 2 * pp else 1
        check_schedule_config(schedule, pp, microbatches, virtual_stages)
        if activation_checkpoint not in ACTIVATION_CHECKPOINT_MODES:
            raise ValueError(
                f"activation_checkpoint={activation_checkpoint!r}; choose one of {list(ACTIVATION_CHECKPOINT_MODES)}"
            )
        ranges = stage_layer_ranges(model, pp * virtual_stages, stage_balance, end_weight, layers_per_stage)
        return cls(build_schedule(schedule, pp, microbatches, virtual_stages), ranges, activation_checkpoint)

    def __str__(self) -> str:
        s = self.schedule
        return (f"{s.name} m={s.microbatches} v={s.virtual_stages} ac={self.activation_checkpoint} "
                f"stages={self.stage_layers}")
