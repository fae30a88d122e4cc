"""The never-drain schedules' tests: a one-process reference that applies their update rules, and
the same training through mesh3d.

The reference follows docs/pipeline.md#never-drain-schedules literally, with torch's own optimizer on
the whole model: it keeps every weight version W_v (all parameters after v rounds of updates; a
stage's version v is its parameters in W_v, since stages update independently), evaluates each
microbatch (pipedream) or batch (pipedream_2bw) with each parameter at the version the rule gives
its stage, and applies the gradient to the newest version.
"""

from __future__ import annotations

import functools

import torch
from pipeline_cases import SEQ_LEN, VOCAB, meta_model, tiny_args
from torch.func import functional_call

import mesh3d
from examples.llama.model import Transformer

LAYERS = 4  # the update rules do not need depth: one block per stage at pp 4, two at pp 2

CALLS = 6
MICROBATCH_SIZE = 2
OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-4),  # pipeline_cases.LR: see docs/testing.md
}


def call_batches(global_batch: int, calls: int = CALLS, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens; about a fifth of the targets masked (-100), so microbatches count different
    numbers of positions and the token mean differs from a mean of means."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(calls):
        tokens = torch.randint(0, VOCAB, (global_batch, SEQ_LEN), generator=generator)
        targets = torch.randint(0, VOCAB, (global_batch, SEQ_LEN), generator=generator)
        targets[torch.rand(targets.shape, generator=generator) < 0.2] = -100
        out.append((tokens, targets))
    return out


def microbatch_union(inputs: torch.Tensor, dp: int, m: int, k: int) -> torch.Tensor:
    """Microbatch k of every dp rank's contiguous share, together (the rule's microbatch k)."""
    return torch.cat([share.chunk(m)[k] for share in inputs.chunk(dp)])


def _loss_sum_count(model, values, tokens, targets):
    logits = functional_call(model, values, (tokens,))
    loss_sum = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return loss_sum, int((targets != -100).sum())


def reference(
    schedule: str, pp: int, m: int, dp: int, tied: bool, data, optimizer: str, stage_of: dict[str, int], lr_factor=None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per call and the final weights (after every update), one process. `lr_factor(t)`:
    the learning rate's factor for the updates of call t's batch (an LR scheduler stepped after
    each call)."""
    torch.manual_seed(0)
    model = Transformer(tiny_args(tied, LAYERS))
    model.init_weights()
    params = dict(model.named_parameters())  # a tied weight once, under its first name
    opt = OPTIMIZERS[optimizer](list(params.values()))
    base_lrs = [group["lr"] for group in opt.param_groups]
    versions = [{n: p.detach().clone() for n, p in params.items()}]  # versions[v]: after v rounds
    call = 0

    def weights_for(stage_version) -> dict[str, torch.Tensor]:
        return {n: versions[stage_version(stage_of[n])][n].clone().requires_grad_() for n in params}

    def apply(grads: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(versions[-1][n])
                p.grad = grads[n].clone()
        if lr_factor is not None:
            for group, base in zip(opt.param_groups, base_lrs):
                group["lr"] = base * lr_factor(call)
        opt.step()
        opt.zero_grad()
        versions.append({n: p.detach().clone() for n, p in params.items()})

    losses = []
    for t, (inputs, targets) in enumerate(data):
        call = t
        if schedule == "pipedream_2bw":
            values = weights_for(lambda stage: max(t - 1, 0))
            total, count = _loss_sum_count(model, values, inputs, targets)
            (total / count).backward()
            losses.append(total.item() / count)
            apply({n: v.grad for n, v in values.items()})
            continue
        total_sum, total_count = 0.0, 0
        for i in range(m):
            k = t * m + i
            values = weights_for(lambda stage: max(0, k - (pp - stage) + 1))
            loss_sum, count = _loss_sum_count(
                model, values, microbatch_union(inputs, dp, m, i), microbatch_union(targets, dp, m, i)
            )
            (loss_sum / count).backward()
            total_sum, total_count = total_sum + loss_sum.item(), total_count + count
            apply({n: v.grad for n, v in values.items()})
        losses.append(total_sum / total_count)
    final = versions[-1]
    state = {}
    for name in model.state_dict():
        source = name if name in final else next(n for n in params if params[n] is model.get_parameter(name))
        state[name] = final[source].numpy().copy()
    return losses, state


def mesh3d_run(
    layout,
    schedule: str,
    m: int,
    tied: bool,
    data,
    optimizer: str,
    lr_factor=None,
    flush_after: int | None = None,
    **kwargs,
):
    """The same calls through mesh3d: losses, the full state after flush, and which stage owns each
    name. `lr_factor`: a LambdaLR on pm.optimizer, stepped after each call; `flush_after`: a
    `pm.flush()` after that many calls, between the others."""
    pm = mesh3d.parallelize(
        meta_model(tied, LAYERS), layout, schedule=schedule, microbatches=m, optimizer=OPTIMIZERS[optimizer], **kwargs
    )
    scheduler = None if lr_factor is None else torch.optim.lr_scheduler.LambdaLR(pm.optimizer, lr_factor)
    losses = []
    for call, (inputs, targets) in enumerate(data):
        share = slice(layout.dp_rank * len(inputs) // layout.dp, (layout.dp_rank + 1) * len(inputs) // layout.dp)
        losses.append(pm.step(inputs[share], targets[share]).item())
        if scheduler is not None:
            scheduler.step()
        if flush_after == call + 1:
            pm.flush()
    pm.flush()
    state = {k: v.numpy().copy() for k, v in pm.full_state_dict().items()}
    owners = {name: pm.state_map.owner_pp_rank(name) for name in state}
    return losses, state, owners, pm


def reference_evaluation(tied: bool, state: dict[str, torch.Tensor], tokens, targets) -> float:
    """The token-mean loss of the model at `state` (the reference's final weights), one process."""
    model = Transformer(tiny_args(tied, LAYERS))
    model.load_state_dict({n: torch.as_tensor(v) for n, v in state.items()})
    with torch.no_grad():
        loss_sum, count = _loss_sum_count(model, dict(model.named_parameters()), tokens, targets)
    return loss_sum.item() / count


def worst(losses, state, ref_losses, ref_state) -> tuple[float, str]:
    errors = [
        (abs(a - b) / max(abs(b), 1e-12), f"loss of call {i}") for i, (a, b) in enumerate(zip(losses, ref_losses))
    ]
    for name, want in ref_state.items():
        got = torch.as_tensor(state[name])
        want = torch.as_tensor(want)
        errors.append(((got - want).norm().item() / max(want.norm().item(), 1e-12), name))
    return max(errors)
