"""How the pipeline's messages are received on CPU (gloo): every receive of a step is posted at its
start, into buffers kept from one step to the next (p2p.py), and this changes no result.

The reference is the same model stepping twice on the same batch without an update: the second
step, which receives into the first step's buffers, must give bit-identical loss and gradients.
(Off the CPU nothing is posted ahead: tests/unit/test_p2p_mailbox.py.)
"""

import torch
import torch.distributed as dist
from multiprocess import run_on_ranks
from pipeline_cases import batches, meta_model

import mesh3d
from mesh3d.pipeline.schedule.ir import Kind


def _receives_and_reuse(schedule: str, virtual_stages: int) -> dict:
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=1)
    m = 4
    pm = mesh3d.parallelize(meta_model(False), layout, schedule=schedule, microbatches=m, virtual_stages=virtual_stages)
    inputs, targets = batches(2 * m)[0]
    receives = [a for a in pm._runtime.train_actions if a.kind in (Kind.RECV_F, Kind.RECV_B)]

    posted, at_first_compute = [], []
    original_irecv = dist.irecv

    def counting_irecv(*args, **kwargs):
        posted.append(1)
        return original_irecv(*args, **kwargs)

    def note_first_compute(_module, _args):
        if not at_first_compute:
            at_first_compute.append(len(posted))

    hooks = [stage.register_forward_pre_hook(note_first_compute) for stage in pm.stages.values()]
    dist.irecv = counting_irecv
    try:
        steps = []
        for _ in range(2):
            posted.clear()
            at_first_compute.clear()
            loss = pm.step(inputs, targets)
            grads = {name: p.grad.clone() for name, p in pm.named_parameters()}
            pm.zero_grad()
            buffers = {slot: buffer.data_ptr() for slot, buffer in pm._runtime.receive_buffers._free.items()}
            steps.append((loss.item(), grads, buffers, at_first_compute[0], len(posted)))
    finally:
        dist.irecv = original_irecv
        for hook in hooks:
            hook.remove()
    (loss1, grads1, buffers1, first1, posted1), (loss2, grads2, buffers2, first2, posted2) = steps
    return {
        "receives": len(receives),
        "posted": (posted1, posted2),
        "posted_before_first_compute": (first1, first2),
        "same_loss": loss1 == loss2,
        "same_grads": all(torch.equal(grads1[n], grads2[n]) for n in grads1),
        "buffers": (len(buffers1), len(buffers2)),
        "same_buffers": buffers1 == buffers2,
    }


def _cases() -> dict:
    return {
        (schedule, v): _receives_and_reuse(schedule, v)
        for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2))
    }


def test_receives_are_posted_at_step_start_into_buffers_kept_between_steps():
    per_rank = run_on_ranks(_cases, 2, timeout=120)
    for rank, outcome in enumerate(per_rank):
        for case, r in outcome.items():
            n = r["receives"]
            assert n > 0, (rank, case, r)
            # Each receive posted once per step, all of them before the first stage runs.
            assert r["posted"] == (n, n) and r["posted_before_first_compute"] == (n, n), (rank, case, r)
            # One buffer per message slot, the same storage in both steps, and no result changed.
            assert r["buffers"] == (n, n) and r["same_buffers"], (rank, case, r)
            assert r["same_loss"] and r["same_grads"], (rank, case, r)
