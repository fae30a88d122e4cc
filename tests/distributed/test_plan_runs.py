"""What mesh3d.plan proposes runs in parallelize unchanged, and trains exactly like one process.

Four ranks, each planning for itself before any process group exists (the planner measures
tensor parallelism over a fake group of its own): the best plan (bf16 compute) takes a step
whose loss is one process's within bf16 rounding, and the best plan computing in fp32 trains
STEPS steps with every loss equal to one process's (fp32, relative 1e-5).
"""

import pytest
import torch
from multiprocess import run_on_ranks
from pipeline_cases import LR, MAX_NORM, SEQ_LEN, STEPS, batches, meta_model, reference_run, tp_args

import mesh3d
from examples.llama.model import loss_fn

pytestmark = pytest.mark.distributed

GLOBAL_BATCH = 8


def _train(plan, data, steps):
    pm = mesh3d.parallelize(meta_model(False, args=tp_args(False)), loss_fn=loss_fn, **plan.parallelize_kwargs())
    optimizer = torch.optim.AdamW(pm.parameters(), lr=LR)
    layout, losses = pm.layout, []
    for inputs, targets in data[:steps]:
        share = slice(layout.dp_rank * len(inputs) // layout.dp, (layout.dp_rank + 1) * len(inputs) // layout.dp)
        losses.append(pm.step(inputs[share], targets[share]).item())
        pm.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _plan_and_run(data):
    sizes = dict(gpus=4, gpus_per_node=4, hardware="h100", seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH)
    best = mesh3d.plan(meta_model(False, args=tp_args(False)), **sizes)[0]
    best_fp32 = mesh3d.plan(meta_model(False, args=tp_args(False)), fix={"param_dtype": None}, **sizes)[0]
    return best.row(), _train(best, data, 1), best_fp32.row(), _train(best_fp32, data, STEPS)


def test_the_best_plans_run_and_equal_one_process():
    data = batches(GLOBAL_BATCH)
    want, _, _ = reference_run(False, data, tp_args(False))
    results = run_on_ranks(_plan_and_run, 4, data, timeout=240)
    for rank, (row, bf16_losses, row_fp32, fp32_losses) in enumerate(results):
        assert (row, row_fp32) == results[0][:1] + results[0][2:3], "every rank plans the same"
        assert bf16_losses[0] == pytest.approx(want[0], rel=2e-2), f"rank {rank}: {row}"
        assert fp32_losses == pytest.approx(want, rel=1e-5), f"rank {rank}: {row_fp32}"
