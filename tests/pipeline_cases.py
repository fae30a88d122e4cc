"""Shared pieces of the pipeline tests: a tiny LLaMA, batches, and the single-process reference."""

from __future__ import annotations

import torch

import mesh3d
from examples.llama.config import ModelArgs
from examples.llama.model import Transformer, loss_fn

SEQ_LEN = 8
VOCAB = 64
STEPS = 2  # the second step runs on the optimizer state the first left
LR = 1e-4  # Adam amplifies fp32 rounding in near-zero grads by up to lr per element; see docs/testing.md
MAX_NORM = 0.5  # small enough that clipping is active, so the norm must be right to match
TOLERANCE = 1e-5  # fp32, relative (norm-relative for tensors)


def tiny_args(tied: bool, n_layers: int = 8) -> ModelArgs:
    return ModelArgs(
        dim=32,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=VOCAB,
        multiple_of=16,
        max_seq_len=SEQ_LEN,
        tie_embeddings=tied,
    )


def tp_args(tied: bool, n_layers: int = 8) -> ModelArgs:
    """Every size tensor parallelism splits (16 heads, 8 kv heads, FFN 176, vocab 64, seq 8) divides tp <= 8."""
    return ModelArgs(
        dim=64,
        n_layers=n_layers,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=VOCAB,
        multiple_of=16,
        max_seq_len=SEQ_LEN,
        tie_embeddings=tied,
    )


def fewest_layers(pp: int, options: dict, blocks_per_stage: int = 1, layers: int = 8) -> int:
    """The fewest layers (at most `layers`) that give `pp` ranks as many stages under `options`
    (schedule, virtual_stages) as a model of `layers` gets, `blocks_per_stage` blocks in each: the
    same schedule on fewer blocks, for tests whose point is the layout, not the depth."""
    from mesh3d.pipeline.schedule.catalog import default_virtual_stages

    schedule = options.get("schedule", "interleaved_1f1b")
    virtual = options.get("virtual_stages") or default_virtual_stages(schedule, pp, layers)
    return min(layers, pp * virtual * blocks_per_stage)


def meta_model(tied: bool, n_layers: int = 8, args: ModelArgs | None = None) -> Transformer:
    with torch.device("meta"):
        return Transformer(args or tiny_args(tied, n_layers))


def batches(batch_size: int, seed: int = 0, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=generator),
            torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=generator),
        )
        for _ in range(steps)
    ]


def reference_run(
    tied: bool, data, args: ModelArgs | None = None
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, whole model, whole batch: losses, grad norms, final state_dict (as numpy arrays,
    which pickle by value: tensors would travel to the ranks as shared-memory file descriptors)."""
    model = Transformer(args or tiny_args(tied))
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for inputs, targets in data:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def pipeline_run(layout, tied: bool, data, args: ModelArgs | None = None, **parallelize_kwargs):
    """The same training through mesh3d.parallelize; returns losses, norms, full state, the pm.

    Each data-parallel rank steps on its own contiguous share of every global batch."""
    # the example's mean loss unless given (loss_fn=None: mesh3d's default (sum, count), which cp needs)
    parallelize_kwargs.setdefault("loss_fn", loss_fn)
    pm = mesh3d.parallelize(meta_model(tied, args=args), layout, **parallelize_kwargs)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses, norms = [], []
    for inputs, targets in data:
        share = slice(layout.dp_rank * len(inputs) // layout.dp, (layout.dp_rank + 1) * len(inputs) // layout.dp)
        losses.append(pm.step(inputs[share], targets[share]).item())
        norms.append(pm.clip_grad_norm_(MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, norms, pm.full_state_dict(), pm


def relative(got, want) -> float:
    if isinstance(want, torch.Tensor):
        return ((got - want).norm() / want.norm()).item()
    return abs(got - want) / abs(want)


def worst_error(result, reference) -> tuple[float, str]:
    """The largest relative error over losses, grad norms and every state_dict entry, and where."""
    losses, norms, state, _ = result
    ref_losses, ref_norms, ref_state = reference
    if sorted(state) != sorted(ref_state):
        return float("inf"), f"keys differ: {sorted(set(state) ^ set(ref_state))}"
    errors = {f"loss {i}": relative(a, b) for i, (a, b) in enumerate(zip(losses, ref_losses))}
    errors |= {f"grad norm {i}": relative(a, b) for i, (a, b) in enumerate(zip(norms, ref_norms))}
    errors |= {name: relative(state[name], torch.from_numpy(ref_state[name])) for name in ref_state}
    where = max(errors, key=errors.get)
    return errors[where], where
