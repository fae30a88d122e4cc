"""Shared pieces of the checkpoint tests: a token dataset, a training loop driven by the loader, results as numpy."""

from __future__ import annotations

import numpy as np
import torch
from pipeline_cases import LR, MAX_NORM, SEQ_LEN, VOCAB, meta_model, tiny_args, tp_args

import mesh3d
from examples.llama.model import loss_fn
from mesh3d.data import DistributedLoader, TokenDataset

GLOBAL_BATCH = 16


def dataset() -> TokenDataset:
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=GLOBAL_BATCH * SEQ_LEN * 8 + 1, dtype=np.int64)
    return TokenDataset(tokens, SEQ_LEN)


def build(layout, tied: bool, *, small: bool = False, init_seed: int = 0, n_layers: int = 8, **parallelize_kwargs):
    """A parallelized tiny LLaMA (tp_args, or tiny_args when small), its AdamW and its loader."""
    args = tiny_args(tied, n_layers) if small else tp_args(tied, n_layers)
    pm = mesh3d.parallelize(meta_model(tied, args=args), layout, loss_fn=loss_fn, **parallelize_kwargs)
    if init_seed:
        for stage in pm.stages.values():
            stage.init_weights(seed=init_seed)  # values a load must overwrite
        pm.weights_replaced()
    optimizer = torch.optim.AdamW(pm.parameters(), lr=LR)
    loader = DistributedLoader.for_layout(dataset(), GLOBAL_BATCH, layout, seed=0)
    return pm, optimizer, loader


def train(pm, optimizer, loader, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        inputs, targets = next(loader)
        losses.append(pm.step(inputs, targets).item())
        pm.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def full_state(pm) -> dict[str, np.ndarray]:
    """The whole model's state as numpy (pickles by value back to the test process)."""
    return {k: v.numpy() for k, v in pm.full_state_dict().items()}


def worst_relative_error(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> tuple[float, str]:
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    errors = {k: float(np.linalg.norm(got[k] - want[k]) / np.linalg.norm(want[k])) for k in want}
    worst = max(errors, key=errors.get)
    return errors[worst], worst
