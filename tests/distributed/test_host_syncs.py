"""No device-to-host synchronization in a training step with its loss unread, on every rank
(issue 65): the batch's check and its agreement run on the host copy of the batch and travel over
the host group; the loss comes back unread on the compute device, and the step's checks that are
device values (a pair loss's recount) are judged by the next call without waiting for it
(step/late_verdicts.py). Reading the loss is the one sync; the gradient norm and its clipping add
none.

Counted on CPU with tests/host_syncs.py, which counts the reads that would stop the host on CUDA
(reads through torch of any tensor; host memory is read through numpy). The batch is given on the
host, as a loader gives it. Every step is counted, the first too (the loss's kind is found on
meta, no exchange), and evaluate, whose flush judges the last step's checks at once (through
numpy, after the copy's event) and whose loss is unread too. The reference is the count itself:
zero, and one once the loss is read (the counter does see the read).
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
        ((2, 1, 2), {}),
        ((1, 2, 2), {"dp_mode": "ddp", "loss_parallel": True}),
        ((2, 1, 1), {"cp": 2, "schedule": "1f1b"}),  # context parallel: its attention verdicts judged late
    ],
}


def _count(world):
    counts = {}
    for (pp, dp, tp), options in CASES[world]:
        kwargs = dict(options)
        layout = mesh3d.build_mesh(pp=pp, dp=dp, cp=kwargs.pop("cp", 1), tp=tp)
        if kwargs.get("loss_parallel"):
            kwargs["tp_plan"] = llama_tp_plan(loss_parallel=True)
        pm = mesh3d.parallelize(meta_model(True, args=tp_args(True)), layout, **kwargs)
        steps, clips, reads = [], [], []
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
            assert loss.device == layout.device and loss.dim() == 0  # on the compute device, unread
            with HostSyncCounter() as syncs:
                loss.item()
            reads.append(syncs.ops)
        with HostSyncCounter() as syncs:
            pm.evaluate(inputs[share], targets[share])
        counts[f"{(pp, dp, tp)} {options}"] = (steps, clips, reads, syncs.ops)
    return counts


@pytest.mark.parametrize("world", [2, 4])
def test_a_step_with_its_loss_unread_stops_the_host_nowhere(world):
    for rank, counts in enumerate(run_on_ranks(_count, world, world, timeout=600)):
        for case, (steps, clips, reads, evaluation) in counts.items():
            for i, ops in enumerate(steps):
                assert not ops, f"rank {rank} {case} step {i + 1}: {len(ops)} syncs: {ops}"
            assert all(not ops for ops in clips), f"rank {rank} {case}: clipping synced: {clips}"
            assert all(len(ops) == 1 for ops in reads), f"rank {rank} {case}: reading the loss: {reads}"
            assert not evaluation, f"rank {rank} {case} evaluate: {evaluation}"
