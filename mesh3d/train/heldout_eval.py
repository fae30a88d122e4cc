"""Held-out evaluation: the same fixed batches at every evaluation, through `pm.evaluate`.

    train, heldout = mesh3d.data.split_heldout(dataset, eval_batches * global_batch, seed)
    evaluator = HeldOutEvaluator(heldout, global_batch, layout, eval_batches)
    if due(step, eval_every, last_step):
        metrics = evaluator(pm)   # {"eval_loss", "eval_perplexity"}, the same on every rank

The held-out samples (mesh3d.data.split_heldout) are cut into `batches` global batches in a fixed
order; each data-parallel rank takes its share of each, as the training loader does. So every
evaluation of a run, on any layout and after any resume, sees exactly the same tokens, and the
eval loss of two layouts differs only by the order of floating-point sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from mesh3d.data.heldout import SampleSubset
from mesh3d.data.loader import DistributedLoader
from mesh3d.mesh import Layout
from mesh3d.parallel_model import ParallelModel


class HeldOutEvaluator:
    """`evaluator(pm)` -> {"eval_loss", "eval_perplexity"}: the mean of the global token-mean
    losses of the held-out batches (each batch has as many tokens as any other, so this is the
    token mean over all of them)."""

    def __init__(
        self,
        heldout: SampleSubset,
        global_batch: int,
        layout: Layout,
        batches: int,
        per_sample: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        if batches < 1:
            raise ValueError(f"batches={batches}: evaluate at least one held-out batch")
        loader = DistributedLoader.for_layout(heldout, global_batch, layout, shuffle=False)
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = [next(loader) for _ in range(batches)]
        self.per_sample = per_sample or (lambda inputs: {})  # the batch's other inputs, as the training step's

    def __call__(self, pm: ParallelModel) -> dict[str, float]:
        """The mean loss over the held-out batches and the perplexity of its cross-entropy (a router
        loss, where the model adds one, counts in the loss but is no likelihood)."""
        losses, cross_entropies = [], []
        for inputs, targets in self.batches:
            losses.append(pm.evaluate(inputs, targets, **self.per_sample(inputs)).item())
            terms = pm.loss_terms
            cross_entropies.append(terms["loss_fn"] if "router_aux" in terms else losses[-1])
        loss, cross_entropy = sum(losses) / len(losses), sum(cross_entropies) / len(cross_entropies)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(cross_entropy, 80.0))}  # exp(80) ~ 5e34


def due(step: int, every: int, last_step: int) -> bool:
    """Evaluate after every `every`-th step and after the last one (steps counted from 1)."""
    return every > 0 and (step % every == 0 or step == last_step)
