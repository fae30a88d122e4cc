"""The router's load-balancing loss across pipeline stages, exact (model/router_aux.py, issue 45).

Qwen3-MoE and Mixtral (tiny: 4 experts, top-2) with `output_router_logits=True` and a coefficient
large enough (0.5) that the loss moves every router: two SGD steps under mesh3d equal
transformers' own model in one process accumulating the same microbatches, each contributing its
cross-entropy sum over the step's target count plus coef x its aux_loss / (dp x m) (every loss,
every parameter, fp32, rel 1e-5). One launch of 4 ranks, (pp, dp, cp, tp):

- (2, 2, 1, 1) under ZBV (split backward, two stages a rank) with FSDP, and with a padding mask
  (the sums weighted by it, as transformers weights them);
- (2, 1, 1, 2) interleaved 1F1B with tensor parallelism (the experts split over tp, the routers whole);
- (2, 1, 2, 1) context parallelism: a microbatch's tokens on two ranks, its counts summed over them;
- Mixtral at (4, 1, 1, 1), 1F1B with selective activation checkpointing, and (2, 2, 1, 1) DDP;
- expert parallelism: Qwen3-MoE at (2, 2, 1, 1) ep 2 under ZBV, padded; Mixtral at (1, 2, 1, 2) ep 4.

`pm.loss_terms` gives the cross-entropy and the router term apart, each equal to the reference's.
"""

from __future__ import annotations

import hf_cases
import pytest
import torch
import torch.nn.functional as F
from multiprocess import run_on_ranks

transformers = pytest.importorskip("transformers")

COEF = 0.5
ROUTED = {
    "qwen3_moe": dict(output_router_logits=True, router_aux_loss_coef=COEF),
    "mixtral": dict(output_router_logits=True, router_aux_loss_coef=COEF),
}
BATCH = 8
# (arch, (pp, dp, cp, tp), parallelize's keywords, batches)
CASES = [
    ("qwen3_moe", (2, 2, 1, 1), dict(schedule="zbv", microbatches=4), "masked"),
    ("qwen3_moe", (2, 2, 1, 1), dict(schedule="1f1b", microbatches=2), "padded"),
    ("qwen3_moe", (2, 1, 1, 2), dict(schedule="interleaved_1f1b", microbatches=2), "masked"),
    ("qwen3_moe", (2, 1, 2, 1), dict(schedule="1f1b", microbatches=2), "masked"),
    ("mixtral", (4, 1, 1, 1), dict(schedule="1f1b", microbatches=4, activation_checkpoint="selective"), "masked"),
    ("mixtral", (2, 2, 1, 1), dict(schedule="1f1b", microbatches=2, dp_mode="ddp"), "masked"),
    # expert parallelism: the experts split over ep ranks, the routers where they were
    ("qwen3_moe", (2, 2, 1, 1), dict(schedule="zbv", microbatches=2, ep=2), "padded"),
    ("mixtral", (1, 2, 1, 2), dict(schedule="gpipe", microbatches=2, ep=4), "masked"),
]


def _batches(kind: str):
    return hf_cases.masked_batches(BATCH) if kind == "masked" else hf_cases.padded_batches(BATCH)


def _on_rank() -> list:
    import mesh3d

    results = []
    for arch, (pp, dp, cp, tp), kwargs, data in CASES:
        layout = mesh3d.build_mesh(pp=pp, dp=dp, cp=cp, tp=tp, ep=kwargs.get("ep", 1))
        pm = mesh3d.parallelize(hf_cases.hf_model(arch, **ROUTED[arch]), layout, **kwargs)
        losses = hf_cases.optimizer_steps(pm, layout, torch.optim.SGD(pm.parameters(), lr=hf_cases.LR), _batches(data))
        results.append((losses, pm.full_state_dict(), pm.loss_terms))
    return results


def _reference(arch: str, dp: int, m: int, data) -> tuple[tuple[list[float], dict], dict]:
    """transformers in one process: each step's dp x m microbatches, in mesh3d's order, accumulated."""
    model = hf_cases.hf_model(arch, **ROUTED[arch])
    optimizer = torch.optim.SGD(model.parameters(), lr=hf_cases.LR)
    losses = []
    for inputs, targets, *extra in data:
        per_sample = extra[0] if extra else {}
        counted = (targets != -100).sum()
        terms = {"loss_fn": 0.0, "router_aux": 0.0}
        for rows in torch.arange(len(inputs)).chunk(dp * m):  # dp shares, each cut into m microbatches
            out = model(inputs[rows], **{k: v[rows] for k, v in per_sample.items()}, use_cache=False)
            ce = F.cross_entropy(out.logits.flatten(0, 1), targets[rows].flatten(), reduction="sum") / counted
            router = COEF * out.aux_loss / (dp * m)
            (ce + router).backward()
            terms["loss_fn"] += ce.item()
            terms["router_aux"] += router.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(terms["loss_fn"] + terms["router_aux"])
    return (losses, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}), terms


def test_router_loss_equals_one_process_accumulating_the_microbatches():
    results = run_on_ranks(_on_rank, 4, timeout=560)
    for index, (arch, (pp, dp, cp, tp), kwargs, data) in enumerate(CASES):
        reference, terms = _reference(arch, dp, kwargs["microbatches"], _batches(data))
        losses, state, got_terms = results[0][index]
        for rank_result in results[1:]:
            assert rank_result[index][0] == losses  # the same loss on every rank
        assert terms["router_aux"] > 0.1 * terms["loss_fn"]  # the router term weighs in
        error, where = hf_cases.worst_error((losses, state), reference)
        assert error <= hf_cases.TOLERANCE, (arch, (pp, dp, cp, tp), kwargs, where, error)
        for name in ("loss_fn", "router_aux"):  # the last step's, apart
            assert abs(got_terms[name] - terms[name]) <= hf_cases.TOLERANCE * abs(terms[name]), (name, got_terms, terms)
