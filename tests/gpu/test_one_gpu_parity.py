"""What one GPU shows: mesh3d at pp = dp = tp = 1 on NCCL trains like one plain process on CPU.

One rank on cuda:0 (a world-size-1 NCCL group), the tiny LLaMA of pipeline_cases, 2 AdamW steps of
8 samples; losses, clipped gradient norms and every parameter compared with the one-process CPU
reference (pipeline_cases.reference_run):
- fp32 with TF32 off, relative error <= 1e-5: one stage (GPipe); two stages on the one rank under
  interleaved 1F1B, zero bubble (v = 2), ZBV and DualPipeV (the catalog takes pp = 1 with
  several stages; the pipeline's messages are then local hand-overs); each activation-checkpoint
  mode; compiled blocks (inductor, tied weights across the two stages); the head fused with the loss;
- bf16 (param_dtype, fp32 master weights and reductions), plain and with the head fused: the same
  run on the GPU and on the CPU, relative error <= 2e-2.
"""

from __future__ import annotations

import torch
from gpu_cases import BF16_TOLERANCE, FP32_TOLERANCE, as_numpy, compile_backend, exact_fp32, needs_gpu, run_on_gpu_ranks
from pipeline_cases import batches, pipeline_run, reference_run, worst_error

import mesh3d
from mesh3d.pipeline import SCHEDULES

pytestmark = needs_gpu

BATCH = 8
SEVERAL_STAGES = {"schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 4}
FP32_CASES = {  # name: (tied, parallelize's arguments)
    "one stage": (False, {"schedule": "gpipe", "microbatches": 2}),
    "interleaved_1f1b v=2": (True, SEVERAL_STAGES),
    "zero_bubble v=2": (False, {"schedule": "zero_bubble", "virtual_stages": 2, "microbatches": 4}),
    "zbv": (True, {"schedule": "zbv", "microbatches": 4}),
    "dualpipev": (True, {"schedule": "dualpipev", "microbatches": 4}),
    "checkpoint always": (True, {**SEVERAL_STAGES, "activation_checkpoint": "always"}),
    "checkpoint except_last": (False, {**SEVERAL_STAGES, "activation_checkpoint": "except_last"}),
    "checkpoint selective": (True, {"schedule": "zbv", "microbatches": 4, "activation_checkpoint": "selective"}),
    "compiled": (True, {**SEVERAL_STAGES, "compile": "compiled"}),  # the backend is the device's
    # the head fused with the default loss (model/fused_head_loss.py), split into I and W under ZBV
    "fused loss zbv": (True, {"schedule": "zbv", "microbatches": 4, "fused_loss": True, "loss_fn": None}),
}
BF16 = (True, {**SEVERAL_STAGES, "param_dtype": torch.bfloat16})
# bf16 with the head fused: the weight's gradient summed over chunks in fp32 (torch.mm's out_dtype on CUDA)
BF16_FUSED = (True, {**SEVERAL_STAGES, "param_dtype": torch.bfloat16, "fused_loss": True, "loss_fn": None})


def _train(device: str, cases: dict) -> dict:
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device=device)
    assert layout.device.type == device and ("nccl" in layout.backend) == (device == "cuda"), layout
    data = batches(BATCH)
    out = {}
    for name, (tied, kwargs) in cases.items():
        if kwargs.get("compile"):
            kwargs = {**kwargs, "compile": compile_backend(device)}
        exact_fp32()
        losses, norms, state, pm = pipeline_run(layout, tied, data, **kwargs)
        out[name] = (losses, norms, as_numpy(state), len(pm.stages))
    return out


def _as_result(outcome):
    losses, norms, state, _ = outcome
    return losses, norms, {k: torch.from_numpy(v) for k, v in state.items()}, None


def test_one_gpu_matches_one_cpu_process(device):
    got = run_on_gpu_ranks(_train, 1, device, FP32_CASES, timeout=600)[0]
    references = {tied: reference_run(tied, batches(BATCH)) for tied in (False, True)}
    failures = []
    for name, (tied, kwargs) in FP32_CASES.items():
        stages = got[name][3]
        want_stages = kwargs.get("virtual_stages") or SCHEDULES[kwargs["schedule"]].fixed_virtual_stages or 1
        if stages != want_stages:
            failures.append(f"{name}: {stages} stages on the rank")
        error, where = worst_error(_as_result(got[name]), references[tied])
        if error > FP32_TOLERANCE:
            failures.append(f"{name}: relative error {error:.2e} at {where}")
    assert not failures, "\n".join(failures)


def test_bf16_on_the_gpu_follows_bf16_on_the_cpu(device):
    cases = {"bf16": BF16, "bf16 fused loss": BF16_FUSED}
    on_device = run_on_gpu_ranks(_train, 1, device, cases, timeout=300)[0]
    on_cpu = run_on_gpu_ranks(_train, 1, "cpu", cases, timeout=300)[0]
    for name in cases:
        error, where = worst_error(_as_result(on_device[name]), on_cpu[name][:3])
        assert error <= BF16_TOLERANCE, f"{name}: {error:.2e} at {where}"
