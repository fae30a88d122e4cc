"""Shared pieces of the tests of models that come as they are (nn.Sequential, traced models): tiny
models, their single-process reference, the parallel run, and the bytes a rank must send,
computed from the shapes alone."""

from __future__ import annotations

import copy

import torch
from pipeline_cases import LR, MAX_NORM, STEPS, TOLERANCE, relative
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import mesh3d

DIM, HIDDEN, VOCAB, SEQ = 16, 32, 48, 6
N_BLOCKS = 8


class Residual(nn.Module):
    """x + W2 tanh(W1 x): a block whose output has its input's shape."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


# Every block's up colwise, down rowwise: a block takes and gives a replicated plain tensor.
BLOCK_TP_PLAN = {"*.up": ColwiseParallel(), "*.down": RowwiseParallel()}


def blocks_model(seed: int = 0) -> nn.Sequential:
    """An nn.Sequential of 8 residual blocks on float vectors."""
    torch.manual_seed(seed)
    return nn.Sequential(*[Residual() for _ in range(N_BLOCKS)])


def token_model(tied: bool, seed: int = 0) -> nn.Sequential:
    """Embedding, 8 blocks, a head: logits over the vocabulary, the head tied to the embedding or not."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Embedding(VOCAB, DIM), *[Residual() for _ in range(N_BLOCKS)], nn.Linear(DIM, VOCAB, bias=False)
    )
    if tied:
        model[-1].weight = model[0].weight
    return model


class SkipModel(nn.Module):
    """Embedding, 8 residual blocks in an nn.ModuleList, a head; a skip connection: tanh of the
    embedding, computed before the first block, is added to the last block's output. Not an
    nn.Sequential, not the protocol: a traced model."""

    def __init__(self, tied: bool, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Residual() for _ in range(N_BLOCKS)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        skip = torch.tanh(h)
        for block in self.blocks:
            h = block(h)
        return self.head(h + skip)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def data(kind: str, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    if kind == "blocks":
        return [(torch.randn(batch, DIM, generator=g), torch.randn(batch, DIM, generator=g)) for _ in range(STEPS)]
    return [
        (torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g))
        for _ in range(STEPS)
    ]


def reference(model: nn.Module, loss_fn, batches) -> tuple[list[float], dict]:
    """One process, the whole model and batch: the losses and the final state (numpy, pickled by value)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs, targets in batches:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def parallel(model: nn.Module, layout, loss_fn, batches, **kwargs) -> tuple[list[float], dict, list[dict], object]:
    """The same training through mesh3d.parallelize (each dp rank on its share): losses, the full
    state, every step's comm_bytes(), the ParallelModel."""
    pm = mesh3d.parallelize(model, layout, loss_fn=loss_fn, **kwargs)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses, sent = [], []
    for inputs, targets in batches:
        share = slice(layout.dp_rank * len(inputs) // layout.dp, (layout.dp_rank + 1) * len(inputs) // layout.dp)
        losses.append(pm.step(inputs[share], targets[share]).item())
        sent.append(pm.comm_bytes())
        pm.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return losses, pm.full_state_dict(), sent, pm


def worst(result, ref) -> tuple[float, str]:
    """The largest relative error over the losses and every state entry, and where."""
    (losses, state), (ref_losses, ref_state) = result, ref
    if sorted(state) != sorted(ref_state):
        return float("inf"), f"names differ: {sorted(set(state) ^ set(ref_state))}"
    errors = {f"loss {i}": relative(a, b) for i, (a, b) in enumerate(zip(losses, ref_losses))}
    errors |= {k: relative(state[k], torch.from_numpy(v)) for k, v in ref_state.items()}
    where = max(errors, key=errors.get)
    return errors[where], where


def stage_ranks(schedule: str, pp: int, virtual: int) -> list[int]:
    """The pp rank of every stage, as docs/pipeline.md lays them out: round robin, the V of zbv and dualpipev."""
    if schedule in ("zbv", "dualpipev"):
        return list(range(pp)) + list(reversed(range(pp)))
    return [s % pp for s in range(pp * virtual)]


def expected_bytes(pp_rank: int, ranks: list[int], microbatches: int, boundary_bytes: int, skip: bool = False) -> dict:
    """{(src, dst): bytes} a rank sends in one step when every boundary carries `boundary_bytes`
    per microbatch each way and a hand-over on one rank sends nothing. `skip`: the first stage
    also sends the last one a tensor of `boundary_bytes` (SkipModel), directly, and gets its
    gradient back the same way; at two stages it travels with the boundary's own tensor."""
    n = len(ranks)
    carried = {(s, s + 1): boundary_bytes for s in range(n - 1)}
    if skip:
        carried[(0, n - 1)] = carried.get((0, n - 1), 0) + boundary_bytes
    expected = {}
    for (producer, consumer), size in carried.items():
        if ranks[producer] == ranks[consumer]:
            continue
        if ranks[producer] == pp_rank:
            expected[(producer, consumer)] = microbatches * size
        if ranks[consumer] == pp_rank:
            expected[(consumer, producer)] = microbatches * size
    return expected


def outcome_failures(case: str, outcome: tuple) -> list[str]:
    """What one rank's case got wrong: its error against one process, an unsharded tp block, its comm_bytes()."""
    (error, where), sent, want, sharded = outcome
    failures = []
    if error > TOLERANCE:
        failures.append(f"{case}: relative error {error:.2e} at {where}")
    if not sharded:
        failures.append(f"{case}: the tp_plan left a block's up projection unsharded")
    if any(step != want for step in sent):
        failures.append(f"{case}: comm_bytes() {sent[0]} (and later steps {sent[1:]}), expected {want}")
    return failures
