"""On CUDA a training step with its loss unread stops the host nowhere (issue 65), and reading
the loss stops it once: counted by torch's own sync debug mode, which warns at every stream
synchronization torch makes, so it also sees what the CPU-side counter (tests/host_syncs.py)
cannot: a copy from pageable host memory without `non_blocking`, which synchronizes the stream
(the batch's inputs and targets were such copies, two stops a step). The step's late checks'
copy into pinned memory is non-blocking (step/late_verdicts.py), and the previous step's are
judged through their event, which the mode does not count as a stream synchronization: a wait for
the earlier step's all-reduce, not for the step just queued.

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


def _stops_in_a_step(device: str) -> tuple[list[str], list[str]]:
    """The stops of a step with its loss unread, and of reading that loss."""
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
            loss = pm.step(inputs, targets)
        with HostSyncCounter() as read:
            loss.item()
        return syncs.ops, read.ops
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as in_step:
            warnings.simplefilter("always")
            loss = pm.step(inputs, targets)
        with warnings.catch_warnings(record=True) as reading:
            warnings.simplefilter("always")
            loss.item()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return _synchronizations(in_step), _synchronizations(reading)


def _synchronizations(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]


def test_a_step_with_its_loss_unread_stops_the_host_nowhere(device):
    in_step, reading = run_on_gpu_ranks(_stops_in_a_step, 1, device, timeout=300)[0]
    assert not in_step, in_step
    assert len(reading) == 1, reading  # the loss read: the mode does see reads
