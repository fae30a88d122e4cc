"""On CUDA a training step stops the host at most twice (the batch check's agreed flag and the
loss it returns; in a world of one only the loss): counted by torch's own sync debug mode, which
warns at every stream synchronization torch makes, so it also sees what the CPU-side counter
(tests/host_syncs.py) cannot: a copy from pageable host memory without `non_blocking`, which
synchronizes the stream (the batch's inputs and targets were such copies, two more stops a step).

One rank, pp = dp = tp = 1, the tiny LLaMA, interleaved 1F1B with two stages on the rank; the step
counted is the second, with the first step's AdamW update queued before it, which any sync would
wait for. Under MESH3D_GPU_TESTS_ON_CPU=1 the same step is counted by HostSyncCounter instead.
"""

from __future__ import annotations

import warnings

import torch
from gpu_cases import needs_gpu, run_on_gpu_ranks
from host_syncs import HostSyncCounter
from pipeline_cases import LR, batches, meta_model

import mesh3d
from examples.llama.model import loss_fn

pytestmark = needs_gpu

STOPS_PER_STEP = 2


def _stops_in_a_step(device: str) -> list[str]:
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device=device)
    pm = mesh3d.parallelize(
        meta_model(True), layout, loss_fn=loss_fn, schedule="interleaved_1f1b", virtual_stages=2, microbatches=4
    )
    optimizer = torch.optim.AdamW(pm.parameters(), lr=LR)
    inputs, targets = batches(8)[0]
    pm.step(inputs, targets)
    optimizer.step()  # queued on the device: a sync in the next step waits for it
    optimizer.zero_grad()
    if device != "cuda":
        with HostSyncCounter() as syncs:
            pm.step(inputs, targets)
        return syncs.ops
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm.step(inputs, targets)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]


def test_a_step_stops_the_host_at_most_twice(device):
    stops = run_on_gpu_ranks(_stops_in_a_step, 1, device, timeout=300)[0]
    assert 1 <= len(stops) <= STOPS_PER_STEP, stops  # the loss is read once: the mode does see reads
