"""A weight-version swap is ordered before every read of the weights it writes, on CUDA streams.

PipeDream-2BW at pp = 1 keeps the previous version and swaps it in before each call's forwards
(weight_versions.py), on the current stream, while FSDP2 (over one rank when dp = 1) gathers the
parameters on streams of its own. The test makes every swap late: a `torch.cuda._sleep` of about
10 ms is queued on the current stream just before it, so the swap's copies land long after the
CPU has issued them; the losses and final weights must still equal the update rule's one-process
reference on CPU (never_drain_cases.reference; fp32, TF32 off, relative error <= 1e-5).

What it cannot show: at pp = 1 every swap precedes the root module's forward, where FSDP2 makes
its gather streams wait for the current stream anyway, so this test also passes without
stream_order.py's waits (checked on an H100 by making them no-ops). The race they close, a swap
between a forward and its backward, needs pp >= 2, two GPUs; tests/unit/test_stream_order.py
holds the waits in place with recorded streams. On CPU (MESH3D_GPU_TESTS_ON_CPU=1) the sleep is
left out.
"""

from __future__ import annotations

import torch
from gpu_cases import FP32_TOLERANCE, exact_fp32, needs_gpu, run_on_gpu_ranks
from never_drain_cases import MICROBATCH_SIZE, call_batches, mesh3d_run, reference, worst

import mesh3d
from mesh3d.pipeline.weight_versions import StageWeights

pytestmark = needs_gpu

MICROBATCHES = 4
SLEEP_CYCLES = 20_000_000  # about 10 ms at GPU clock rates


def _late_swaps(device: str):
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device=device)
    exact_fp32()
    swaps = []
    use = StageWeights.use

    def late_use(weights: StageWeights, version: int, oldest_needed: int) -> None:
        if version != weights.live:
            swaps.append(version)
            if device == "cuda":
                torch.cuda._sleep(SLEEP_CYCLES)  # the current stream is busy: the swap lands late
        use(weights, version, oldest_needed)

    StageWeights.use = late_use
    data = call_batches(MICROBATCH_SIZE * MICROBATCHES)
    losses, state, owners, _ = mesh3d_run(layout, "pipedream_2bw", MICROBATCHES, True, data, "adamw")
    return losses, state, owners, len(swaps)


def test_late_swaps_give_the_update_rules_numbers(device):
    losses, state, owners, swaps = run_on_gpu_ranks(_late_swaps, 1, device, timeout=300)[0]
    assert swaps >= 2, f"only {swaps} swaps: the schedule never ran an older version"
    data = call_batches(MICROBATCH_SIZE * MICROBATCHES)
    ref_losses, ref_state = reference("pipedream_2bw", 1, MICROBATCHES, 1, True, data, "adamw", owners)
    error, where = worst(losses, state, ref_losses, ref_state)
    assert error <= FP32_TOLERANCE, f"{error:.2e} at {where}"
