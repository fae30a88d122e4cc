"""The loss: the default next-token cross-entropy, and checking a loss function before a step.

`loss_fn(output, target)` returns the mean loss of one microbatch; the pipeline runtime calls it
on the last stage only.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Default loss: mean cross-entropy over every position, logits (..., vocab) in fp32."""
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


def check_loss_on_meta(
    loss_fn: LossFn, output: torch.Tensor, target: torch.Tensor, context: Callable[[], AbstractContextManager]
) -> None:
    """Run `loss_fn` on the meta output of the model and a meta target of `target`'s shape and dtype.

    A target that does not fit the output then fails on every rank before the step, not on the
    last stage's rank alone in the middle of the schedule. Best effort: a loss that cannot run on
    meta tensors (class weights on a device, boolean masks, .item()) is not checked.
    """
    try:
        with context(), torch.no_grad():
            loss_fn(output, torch.empty(target.shape, dtype=target.dtype, device="meta"))
    except Exception as error:
        # No meta kernel, data-dependent ops (.item(), masks) or real tensors mixed in: this check
        # cannot tell, the real run will. Anything else is the loss's verdict.
        if not isinstance(error, NotImplementedError) and "meta" not in str(error).lower():
            raise ValueError(
                f"loss_fn fails on the model's output {tuple(output.shape)} {output.dtype} and a target microbatch "
                f"{tuple(target.shape)} {target.dtype}: {error}"
            ) from error
