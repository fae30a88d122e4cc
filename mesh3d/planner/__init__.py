"""The layout planner: which (pp, dp, cp, tp, schedule, microbatches, checkpointing) to run, before renting GPUs.

    plans = mesh3d.planner.plan("llama3-70b", gpus=256, hardware="h100", seq_len=8192, global_batch=512)
    best = plans[0]                        # the fastest layout that fits (within its band, with room)
    mesh3d.parallelize(model, **best.parallelize_kwargs())

`Plan` is one ranked row (its MemoryBreakdown included); `Hardware` (HARDWARE: the named ones,
with their CollectiveTimes) describes the machine. `predict_memory` is the prediction for the layout
a run is on, said beside its first measured peak (`MemoryPrediction`; `wants_prediction`: on CUDA by
default). `dry_run` plays sampled ranks of a job of any size on this CPU, the real setup and step
under torch's fake process group, each rank's `RankReport` beside the planner's bytes ("Before you
rent"). See docs/plan.md for the model's terms and its validation against published runs.
"""

from mesh3d.planner.fake_cluster import RankReport, dry_run
from mesh3d.planner.hardware import HARDWARE, CollectiveTimes, Hardware
from mesh3d.planner.planned_layout import Plan
from mesh3d.planner.predict.memory import MemoryBreakdown
from mesh3d.planner.ranking import plan
from mesh3d.planner.run_memory import MemoryPrediction, predict_memory, wants_prediction

__all__ = [
    "HARDWARE",
    "CollectiveTimes",
    "Hardware",
    "MemoryBreakdown",
    "MemoryPrediction",
    "Plan",
    "RankReport",
    "dry_run",
    "plan",
    "predict_memory",
    "wants_prediction",
]
