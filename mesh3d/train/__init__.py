"""The reusable parts of a training loop, each one concept (like torchtitan's components).

    from mesh3d.train import resume_latest, resume_from, BadStepGuard, HeldOutEvaluator, Progress

- resume.py: the newest undamaged checkpoint under a root, agreed by every rank
  (`resume_latest`; `checkpoints_newest_first`), or exactly the checkpoint asked for (`resume_from`);
- nonfinite_steps.py: skip an optimizer step whose gradient norm is NaN or Inf, stop after
  `max_bad_steps` in a row (`BadStepGuard`, `TooManyBadSteps`); for the never-drain schedules,
  which update inside `pm.step`, stop after `max_bad_steps` non-finite losses in a row (`BadLossGuard`);
- device_step_guard.py: the same skip and count on the device, read only on logging steps
  (`DeviceStepGuard`: a fused optimizer's `found_inf`);
- unread_steps.py: each step's loss, grad norm and flags held unread, read at once on logging
  steps (`UnreadSteps`);
- heldout_eval.py: the held-out loss on the same fixed batches at every evaluation
  (`HeldOutEvaluator`, `due`);
- flops.py: FLOPs per token counted over one forward and backward of the model
  (`flops_per_token`), the device's peak FLOP/s (`peak_flops`), and the model FLOPs utilization
  (`mfu`);
- expert_bias.py: DeepSeek-V3's auxiliary-loss-free balancing, each router's bias moved toward
  the experts' mean load after a step (`update_expert_bias`, from `pm.expert_load()`);
- expert_load_record.py: a mixture's loads (`pm.expert_load()`) as a metrics row's columns (every
  block's tokens per expert, the worst block's max/mean) and a progress line's column
  (`expert_load_record`, `imbalance_column`);
- progress.py: the progress line (step, loss, lr, elapsed time, ETA, tokens/s, MFU) in human
  units (`Progress`, `human_count`, `human_duration`);
- step_memory.py: each step's memory over every rank, each rank's rise over what it held before the
  model was built and the rank that rose most, CUDA's allocated and reserved or the CPU's resident
  peak (`StepMemory`, `MemoryPeak`; the planner's prediction to say beside it:
  `mesh3d.planner.predict_memory`).

examples/llama/train.py composes them; a loop of your own can take any of them alone. They sit
above the rest of mesh3d (they use checkpoint, data and a ParallelModel); no other room of mesh3d
imports them (only the package face, `mesh3d.train`).
"""

from mesh3d.train.device_step_guard import DeviceStepGuard
from mesh3d.train.expert_bias import update_expert_bias
from mesh3d.train.expert_load_record import expert_load_record, imbalance_column
from mesh3d.train.flops import flops_per_token, mfu, peak_flops
from mesh3d.train.heldout_eval import HeldOutEvaluator, due
from mesh3d.train.nonfinite_steps import BadLossGuard, BadStepGuard, TooManyBadSteps
from mesh3d.train.progress import Progress, human_count, human_duration
from mesh3d.train.resume import checkpoints_newest_first, resume_from, resume_latest
from mesh3d.train.step_memory import MemoryPeak, StepMemory
from mesh3d.train.unread_steps import UnreadSteps

__all__ = [
    "BadLossGuard",
    "BadStepGuard",
    "DeviceStepGuard",
    "HeldOutEvaluator",
    "MemoryPeak",
    "Progress",
    "StepMemory",
    "TooManyBadSteps",
    "UnreadSteps",
    "checkpoints_newest_first",
    "due",
    "expert_load_record",
    "flops_per_token",
    "human_count",
    "human_duration",
    "imbalance_column",
    "mfu",
    "peak_flops",
    "resume_from",
    "resume_latest",
    "update_expert_bias",
]
