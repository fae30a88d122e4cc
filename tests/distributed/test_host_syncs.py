"""At most two device-to-host synchronizations per training step on every rank (issue 37): the
agreed verdict on the batch (which carries a pair loss's global count), and the loss the step
returns. The gradient norm and its clipping add none.

Counted on CPU with tests/host_syncs.py, which counts the reads that would stop the host on CUDA.
The batch is given on the host, as a loader gives it; its check reads it there, before the
transfer. Every step is counted, the first too (the loss's kind is found on meta, no exchange),
and evaluate; the loss comes back on the host, so reading it waits for nothing.
"""

import functools

import pytest
import torch
from host_syncs import HostSyncCounter
from multiprocess import run_on_ranks
from pipeline_cases import LR, batches, meta_model, tp_args

import mesh3d
from examples.llama.model import llama_tp_plan, loss_fn

GLOBAL_BATCH = 8
MOST_PER_STEP = 2

# The default loss (a (sum, count) pair: the count found before the step) unless loss_fn is named.
CASES = {
    2: [
        ((2, 1, 1), {"schedule": "1f1b"}),
        ((1, 2, 1), {"dp_mode": "fsdp", "loss_fn": loss_fn}),
        ((2, 1, 1), {"schedule": "pipedream", "optimizer": functools.partial(torch.optim.AdamW, lr=LR)}),
    ],
    4: [
        ((2, 2, 1), {}),
        ((2, 1, 2), {"schedule": "zbv", "microbatches": 4, "loss_fn": loss_fn}),
        ((1, 2, 2), {"dp_mode": "ddp", "loss_parallel": True}),
    ],
}


def _count(world):
    counts = {}
    for (pp, dp, tp), options in CASES[world]:
        layout = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
        kwargs = dict(options)
        if kwargs.get("loss_parallel"):
            kwargs["tp_plan"] = llama_tp_plan(loss_parallel=True)
        pm = mesh3d.parallelize(meta_model(True, args=tp_args(True)), layout, **kwargs)
        steps, clips = [], []
        for inputs, targets in batches(GLOBAL_BATCH):
            share = slice(layout.dp_rank * len(inputs) // dp, (layout.dp_rank + 1) * len(inputs) // dp)
            with HostSyncCounter() as syncs:
                loss = pm.step(inputs[share], targets[share])
            steps.append(syncs.ops)
            if not pm.never_drains:
                with HostSyncCounter() as syncs:
                    pm.clip_grad_norm_(0.5)
                clips.append(syncs.ops)
                pm.zero_grad()
            assert loss.device.type == "cpu"  # read on the host: `.item()` waits for no device
        with HostSyncCounter() as syncs:
            pm.evaluate(inputs[share], targets[share])
        counts[f"{(pp, dp, tp)} {options}"] = (steps, clips, syncs.ops)
    return counts


@pytest.mark.parametrize("world", [2, 4])
def test_a_step_stops_the_host_at_most_twice(world):
    for rank, counts in enumerate(run_on_ranks(_count, world, world, timeout=600)):
        for case, (steps, clips, evaluation) in counts.items():
            for i, ops in enumerate(steps):
                assert len(ops) <= MOST_PER_STEP, f"rank {rank} {case} step {i + 1}: {len(ops)} syncs: {ops}"
            assert all(not ops for ops in clips), f"rank {rank} {case}: clipping or reading the loss synced: {clips}"
            assert len(evaluation) <= MOST_PER_STEP, f"rank {rank} {case} evaluate: {evaluation}"
