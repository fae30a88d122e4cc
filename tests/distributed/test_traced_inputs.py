"""A traced model taking two inputs: the tokens and a per-sample `scale` (named by its example
inputs, `(tokens, {"scale": scale})`), read on the first stage (scaling the embedding) and on the
last (scaling what the head sees), handed to each from the step's batch, not routed.

At pp = 2 under 1F1B (a stage per rank) and ZBV (both ends on rank 0), three AdamW steps: the
losses and every parameter after them equal the model in one process given the same scales
(fp32, relative 1e-5). The scale is real: without it the reference's loss differs. A block called
with the scale and its activation, whose argument order torch's frontend does not keep, is refused
by name on every rank before any message.
"""

from __future__ import annotations

import copy

import torch
from multiprocess import run_on_ranks
from pipeline_cases import LR, MAX_NORM, TOLERANCE
from rank_errors import assert_raised_on_every_rank, messages_of
from sequential_cases import DIM, N_BLOCKS, SEQ, VOCAB, Residual, token_loss, worst
from torch import nn

import mesh3d

BATCH, MICROBATCHES, STEPS = 8, 4, 3


class ScaledModel(nn.Module):
    """Embedding, 8 residual blocks, a head; `scale` (batch, seq) multiplies the embedding and the
    head's input."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Residual() for _ in range(N_BLOCKS)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) * scale[..., None]
        for block in self.blocks:
            h = block(h)
        return self.head(h * scale[..., None])


class ScaledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Residual()

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.inner(h) * scale[..., None]


class ScaleInBlocks(ScaledModel):
    """The scale handed to every block with its activation: refused."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ScaledBlock() for _ in range(N_BLOCKS)])

    def forward(self, ids: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, scale)
        return self.head(h)


def batches(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            0.5 + torch.rand(BATCH, SEQ, generator=g),
        )
        for _ in range(STEPS)
    ]


def reference(data, use_scale: bool = True):
    model = ScaledModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids, targets, scale in data:
        loss = token_loss(model(ids, scale=scale if use_scale else torch.ones_like(scale)), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _on_rank(data):
    layout = mesh3d.build_mesh(pp=2)
    ids, _, scale = data[0]
    example = (ids[: BATCH // MICROBATCHES], {"scale": scale[: BATCH // MICROBATCHES]})
    out = {}
    for schedule in ("1f1b", "zbv"):
        pm = mesh3d.parallelize(
            copy.deepcopy(ScaledModel()),
            layout,
            loss_fn=token_loss,
            schedule=schedule,
            microbatches=MICROBATCHES,
            example_inputs=example,
        )
        optimizer = torch.optim.AdamW(pm.parameters(), lr=LR)
        losses = []
        for step_ids, targets, step_scale in data:
            losses.append(pm.step(step_ids, targets, scale=step_scale).item())
            pm.clip_grad_norm_(MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
        out[schedule] = (losses, pm.full_state_dict())
    refusal = messages_of(
        {"scale in blocks": lambda: mesh3d.parallelize(ScaleInBlocks(), layout, example_inputs=example)}
    )
    return out if layout.rank == 0 else None, refusal


def test_a_traced_model_taking_two_inputs_equals_one_process():
    data = batches()
    ref = reference(data)
    assert abs(reference(data, use_scale=False)[0][0] - ref[0][0]) > 1e-3 * abs(ref[0][0]), "the scale is not read"
    per_rank = run_on_ranks(_on_rank, 2, data, timeout=300)
    for schedule, result in per_rank[0][0].items():
        error, where = worst(result, ref)
        assert error <= TOLERANCE, (schedule, where, error)
    assert_raised_on_every_rank(
        [refusal for _, refusal in per_rank],
        {"scale in blocks": "stage 0: module 'blocks.0' is called with the per-sample input(s) ['scale'] and 1 other"},
    )
