"""parallelize's pipeline arguments, checked and resolved before anything is built.

Pure arithmetic on sizes and the (meta) model, so every rank raises the same error before any
collective. The schedule is checked once (by the catalog, as it is built) and lowered here, for
training and for evaluation, so the runtime is handed both lists ready to run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from mesh3d.model.anatomy import Anatomy
from mesh3d.model.traced.capture import TracedSplit
from mesh3d.pipeline.routes import StageRoutes
from mesh3d.pipeline.schedule.catalog import (
    SCHEDULES,
    ScheduleSpec,
    build_schedule,
    default_microbatches,
    default_virtual_stages,
)
from mesh3d.pipeline.schedule.ir import Schedule
from mesh3d.pipeline.schedule.lower import LoweredSchedule, lower
from mesh3d.pipeline.schedule.never_drain import NeverDrainStream, never_drain_stream
from mesh3d.pipeline.split import split_point_counts, stage_layer_ranges
from mesh3d.pipeline.tied import ties_across_stages

ACTIVATION_CHECKPOINT_MODES = ("never", "always", "except_last", "selective")


@dataclass(frozen=True)
class PipelineConfig:
    """The schedule lowered for training and for evaluation (forwards only), the layers of every
    stage, the activation checkpointing mode, and what flows between the stages (for a traced
    model, its capture cut at the stages' first blocks)."""

    training: LoweredSchedule
    evaluation: LoweredSchedule
    stage_layers: list[range]
    activation_checkpoint: str
    routes: StageRoutes
    traced: TracedSplit | None = None

    @property
    def schedule(self) -> Schedule:
        """The training schedule's compute IR (sizes, stage placement)."""
        return self.training.schedule

    @property
    def spec(self) -> ScheduleSpec:
        """The catalog's entry for the schedule: what its name implies."""
        return SCHEDULES[self.schedule.name]

    @property
    def never_drains(self) -> bool:
        """Calls overlap and the weights update inside the pipeline (never_drain.py)."""
        return self.spec.never_drains

    @property
    def loss_per_microbatch(self) -> bool:
        """Each microbatch is an update of its own, its loss scaled as a whole batch's."""
        return self.spec.loss_per_microbatch

    def tie_holders(self, ties: list[list[str]], meta_stages: list[nn.Module]) -> tuple[tuple[int, ...], ...]:
        """The stages holding each weight tied across stages, which a never-drain schedule's
        stream joins the updates of (none for a schedule that drains: its ties sync after the step)."""
        return ties_across_stages(self.schedule.name, ties, meta_stages) if self.never_drains else ()

    def never_drain_stream(self, tie_holders: tuple[tuple[int, ...], ...]) -> NeverDrainStream | None:
        """The never-drain schedule's stream of calls (None for a schedule that drains)."""
        if not self.never_drains:
            return None
        return never_drain_stream(self.schedule.name, self.schedule.pp, self.schedule.microbatches, tie_holders)

    @classmethod
    def resolve(
        cls,
        model: nn.Module,
        anatomy: Anatomy,
        pp: int,
        *,
        schedule: str,
        microbatches: int | None,
        virtual_stages: int | None,
        activation_checkpoint: str,
        layers_per_stage: Sequence[int] | None,
        stage_balance: str,
        end_weight: float,
        split_points: Sequence[str] | None = None,
    ) -> PipelineConfig:
        """Defaults from the catalog (schedule/catalog.py): microbatches = pp; virtual_stages as
        each schedule's `virtual_stages_rule` says. `split_points` (block names where stages begin)
        gives the counts per stage, as `layers_per_stage` would."""
        blocks = anatomy.block_names(model)
        n_layers = len(blocks)
        if split_points is not None:
            if layers_per_stage is not None:
                raise ValueError("parallelize: give split_points or layers_per_stage, not both")
            layers_per_stage = split_point_counts(anatomy, blocks, split_points)
        if microbatches is None:
            microbatches = default_microbatches(pp)
        if virtual_stages is None:
            virtual_stages = default_virtual_stages(schedule, pp, n_layers)
        built = build_schedule(schedule, pp, microbatches, virtual_stages)  # checks the sizes
        if activation_checkpoint not in ACTIVATION_CHECKPOINT_MODES:
            raise ValueError(
                f"activation_checkpoint={activation_checkpoint!r}; choose one of {list(ACTIVATION_CHECKPOINT_MODES)}"
            )
        ranges = stage_layer_ranges(model, anatomy, pp * virtual_stages, stage_balance, end_weight, layers_per_stage)
        # a router loss's sums travel beside the activation (model/router_aux.py)
        traced, routes = None, StageRoutes.chain(len(ranges), 1 if anatomy.router_aux is None else 2)
        if anatomy.traced is not None:
            traced = anatomy.traced.split([anatomy.block_path(blocks[r.start]) for r in ranges[1:]])
            routes = StageRoutes(len(ranges), traced.skips, traced.takes)
        return cls(
            lower(built, routes.skips),
            lower(built.forward_only(), routes.skips),
            ranges,
            activation_checkpoint,
            routes,
            traced,
        )

    def __str__(self) -> str:
        s = self.schedule
        return (
            f"{s.name} m={s.microbatches} v={s.virtual_stages} ac={self.activation_checkpoint} "
            f"stages={self.stage_layers}"
        )
