"""`Plan`: one layout `mesh3d.plan` ranked, and what it predicts for it (ranking.py makes them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mesh3d.planner.predict.memory import MemoryBreakdown
from mesh3d.planner.predict.step_time import StepTime


@dataclass(frozen=True)
class Plan:
    """One layout and what the planner predicts for it."""

    pp: int
    dp: int
    tp: int
    schedule: str
    virtual_stages: int
    microbatches: int
    activation_checkpoint: str
    dp_mode: str
    param_dtype: torch.dtype | None
    compile: bool
    local_batch: int  # sequences each dp rank's step takes
    microbatch_size: int
    memory_per_rank: MemoryBreakdown
    step_seconds: float
    tokens_per_second_per_gpu: float
    mfu: float
    bubble_fraction: float
    time: StepTime = field(repr=False)
    # every pp rank's peak (its fullest dp and tp rank), by pp rank; memory_per_rank is the largest
    memory_by_pp_rank: tuple[MemoryBreakdown, ...] = field(default=(), repr=False)
    # a traced model: the tokens of one microbatch it is captured with (meta, microbatch_size x seq_len)
    example_inputs: tuple | None = field(default=None, repr=False, compare=False)  # tensors: not compared
    split_points: tuple[str, ...] | None = None  # as given to `plan`
    reshard_after_forward: bool | None = None  # FSDP over dp x cp > 1; None under DDP or dp x cp = 1
    cp: int = 1  # context parallelism: each sequence cut over cp ranks (a cp group shares its rows)
    ep: int = 1  # expert parallelism: each block's experts split over ep ranks of a stage
    dp_shard: int | None = None  # HSDP: the dp ranks (a node's) that shard a stage; replicas across nodes
    error_band: float = 0.0  # the band its speed was ranked with (band.py): +- this fraction
    fused_loss: bool = False  # the head fused with the loss (parallelize's fused_loss; pinned, never searched)
    layers_per_stage: tuple[int, ...] | None = None  # as given to `plan`
    # bytes each pp rank (its dp, cp, tp rank 0) sends in a step, by group kind (predict/traffic.py);
    # what it leaves unpredicted (a kind of group) said in traffic_why_not
    traffic_by_pp_rank: tuple[dict[str, float], ...] = field(default=(), repr=False, compare=False)
    traffic_why_not: str = field(default="", repr=False, compare=False)

    def parallelize_kwargs(self) -> dict:
        """What to hand `mesh3d.parallelize(model, **kwargs)` to run exactly this plan (a traced
        model's `example_inputs` and any `split_points` or `layers_per_stage` included)."""
        kwargs = dict(
            pp=self.pp,
            dp=self.dp,
            tp=self.tp,
            **({"cp": self.cp} if self.cp > 1 else {}),
            **({"ep": self.ep} if self.ep > 1 else {}),
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
            microbatches=self.microbatches,
            activation_checkpoint=self.activation_checkpoint,
            dp_mode=self.dp_mode,
            param_dtype=self.param_dtype,
            compile=self.compile,
        )
        if self.example_inputs is not None:
            kwargs["example_inputs"] = self.example_inputs
        if self.split_points is not None:
            kwargs["split_points"] = list(self.split_points)
        if self.layers_per_stage is not None:
            kwargs["layers_per_stage"] = list(self.layers_per_stage)
        if self.reshard_after_forward is not None:
            kwargs["reshard_after_forward"] = self.reshard_after_forward
        if self.dp_shard is not None:
            kwargs["dp_shard"] = self.dp_shard
        if self.fused_loss:
            kwargs["fused_loss"] = True
        return kwargs

    def row(self) -> str:
        dtype = "fp32" if self.param_dtype is None else str(self.param_dtype).removeprefix("torch.")
        return (
            f"pp={self.pp} dp={self.dp}{f' cp={self.cp}' if self.cp > 1 else ''} tp={self.tp}"
            f"{f' ep={self.ep}' if self.ep > 1 else ''} "
            f"{self.schedule} v={self.virtual_stages} "
            f"m={self.microbatches} ac={self.activation_checkpoint} {self.dp_mode}"
            f"{f' dp_shard={self.dp_shard}' if self.dp_shard else ''}"
            f"{' reshard' if self.reshard_after_forward and self.pp > 1 else ''} {dtype}"
            f"{' compile' if self.compile else ''}{' fused_loss' if self.fused_loss else ''}"
        )
