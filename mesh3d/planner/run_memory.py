"""The planner's memory prediction for the layout a run is on, said beside its first measured peak.

    prediction = predict_memory(meta_model, layout, seq_len=2048, global_batch=32, **parallelize_kwargs)
    ...                                         # the first step, its peak gathered (step_memory.py)
    print(prediction.beside(peak))              # "memory: predicted 37.1 GiB (mesh3d.plan, fullest rank), measured ..."
    peak.describe(prediction.planned_for(peak)) # the figure for the reported rank's stage: "(rank 5, planned 36.2 GiB)"

`mesh3d.plan` with every choice of the run pinned evaluates that one layout (docs/plan.md): each pp
rank's parameters, gradients, optimizer state, activations and buffers (its fullest dp and tp
rank), the fullest of them its headline. On CUDA that is what `torch.cuda.max_memory_allocated`
counts; on the CPU the resident peak also holds the interpreter and its libraries, so the figure
held against it is the rise over what the rank held before the model was built (step_memory.py).
A layout the planner does not model (the never-draining schedules, a model it cannot measure) is
said as such, with the planner's reason: the prediction never stops a run.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch
from torch import nn

from mesh3d.mesh import Layout
from mesh3d.parallelize import parallelize
from mesh3d.pipeline.schedule.catalog import default_microbatches, default_virtual_stages
from mesh3d.planner.measure.measured_stages import planner_anatomy
from mesh3d.planner.planned_layout import Plan
from mesh3d.planner.ranking import plan
from mesh3d.train.step_memory import GIB, MemoryPeak

# parallelize's keywords the planner pins by the same name
_PINNED = ("schedule", "virtual_stages", "microbatches", "activation_checkpoint", "dp_mode", "compile", "fused_loss")


@dataclass(frozen=True)
class MemoryPrediction:
    """The planner's bytes for the fullest rank, or None and why not; and for each pp rank."""

    predicted_bytes: int | None
    why_not: str = ""
    by_pp_rank: tuple[int, ...] = ()  # each pp rank's bytes (its fullest dp and tp rank)

    def planned_for(self, peak: MemoryPeak) -> int | None:
        """The planner's bytes for the rank `peak` reports (by its pp rank), or None."""
        if self.predicted_bytes is None:
            return None
        if not self.by_pp_rank or not peak.pp_ranks:
            return self.predicted_bytes
        return self.by_pp_rank[peak.pp_ranks[peak.rank]]

    def beside(self, peak: MemoryPeak) -> str:
        """One line: the prediction and the first step's measured rise (and, on the CPU, what it rose from)."""
        measured = f"measured {peak.rise_bytes / GIB:.2f} GiB (rank {peak.rank})"
        if peak.reserved_bytes is None and peak.baselines:  # the CPU: the interpreter's share said, not counted
            measured += (
                f": its resident peak {peak.peak_bytes / GIB:.2f} GiB less the "
                f"{peak.baselines[peak.rank] / GIB:.2f} GiB it held before the model was built"
            )
        if self.predicted_bytes is None:
            return f"memory: no prediction ({self.why_not}); {measured}"
        return f"memory: predicted {self.predicted_bytes / GIB:.2f} GiB (mesh3d.plan, the fullest rank), {measured}"

    def as_record(self, peak: MemoryPeak | None = None) -> dict[str, float | list[float]]:
        """The first metrics row's columns (GiB), where there is a prediction: the fullest rank's, and
        with `peak` (which pp rank each rank is) every rank's, in rank order."""
        if self.predicted_bytes is None:
            return {}
        record: dict[str, float | list[float]] = {"memory_predicted_gib": self.predicted_bytes / GIB}
        if peak is not None and peak.pp_ranks and self.by_pp_rank:
            record["memory_predicted_gib_by_rank"] = [self.by_pp_rank[pp] / GIB for pp in peak.pp_ranks]
        return record


def predict_memory(
    model: nn.Module, layout: Layout, *, seq_len: int, global_batch: int, **parallelize_kwargs
) -> MemoryPrediction:
    """The planner's prediction for `model` (on meta, before `parallelize`) run on `layout` with
    these `parallelize` keywords. It measures the model (seconds; on one rank is enough, every
    rank gets the same figure)."""
    try:
        planned = plan_for_layout(model, layout, seq_len=seq_len, global_batch=global_batch, **parallelize_kwargs)
    except Exception as error:  # noqa: BLE001 - a prediction that cannot be made is said, never raised
        return MemoryPrediction(None, f"{type(error).__name__}: {str(error).splitlines()[0]}")
    by_pp_rank = tuple(memory.total for memory in planned.memory_by_pp_rank)
    return MemoryPrediction(planned.memory_per_rank.total, "", by_pp_rank)


def plan_for_layout(
    model: nn.Module,
    layout: Layout,
    *,
    seq_len: int,
    global_batch: int,
    gpus_per_node: int | None = None,
    **parallelize_kwargs,
) -> Plan:
    """`mesh3d.plan`'s Plan for exactly this layout and these `parallelize` keywords (every choice
    pinned). gpus_per_node: default torchrun's LOCAL_WORLD_SIZE, else the world."""
    defaults = {name: p.default for name, p in inspect.signature(parallelize).parameters.items()}
    given = {**{k: defaults[k] for k in _PINNED}, **parallelize_kwargs}  # what parallelize will run
    fix = {k: given[k] for k in _PINNED if given[k] is not None}  # None: parallelize's catalog decides
    fix.update(pp=layout.pp, dp=layout.dp, cp=layout.cp, tp=layout.tp, ep=layout.ep)
    fix["param_dtype"] = given.get("param_dtype", defaults["param_dtype"])
    if given.get("dp_shard") is not None:  # HSDP's groups as the run makes them, not the node's
        fix["dp_shard"] = given["dp_shard"]
    if given.get("reshard_after_forward") is not None:
        fix["reshard_after_forward"] = given["reshard_after_forward"]
    if gpus_per_node is None:
        gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
    _pin_defaults(fix, model, seq_len)
    plans = plan(
        model,
        gpus=layout.world_size,
        gpus_per_node=gpus_per_node,
        seq_len=seq_len,
        global_batch=global_batch,
        memory_limit=2**60,  # say what it needs, whatever the device holds
        fix=fix,
        tie_band=0,
        split_points=given.get("split_points"),
        layers_per_stage=given.get("layers_per_stage"),
    )
    return plans[0]


def _pin_defaults(fix: dict, model: nn.Module, seq_len: int) -> None:
    """The microbatches and virtual stages parallelize takes when none are given (its catalog's)."""
    fix.setdefault("microbatches", default_microbatches(fix["pp"]))
    if "virtual_stages" not in fix:
        n_layers = len(planner_anatomy(model, seq_len).block_names(model))
        fix["virtual_stages"] = default_virtual_stages(fix["schedule"], fix["pp"], n_layers)


def wants_prediction(device: torch.device, asked: bool) -> bool:
    """On CUDA by default (the allocator's peak is what the planner counts); on the CPU when asked."""
    return asked or device.type == "cuda"
