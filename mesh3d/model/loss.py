"""The loss contract: what `loss_fn(output, target)` may return, the default loss, and how each
microbatch's loss is scaled before its backward so that the step's gradients are those of one
process on the whole global batch.

A loss function returns either
- a 0-dim mean (a "mean" loss): the step averages the microbatch means, each scaled by 1/m. Right
  when every microbatch counts the same number of elements; wrong with masked targets, where a
  microbatch with 3 counted tokens would weigh as much as one with 300; or
- a pair `(loss_sum, count)` (a "pair" loss): the summed loss and the integer number of elements
  it sums. The step's loss is sum(loss_sums) / sum(counts) over every microbatch of every dp rank,
  and each loss_sum is divided by that global count before its backward. The count is needed before
  the first backward (1F1B runs a backward before the last forward), so it is found from the
  targets before the schedule runs: by the loss's own `count(target)` method if it has one (the
  default loss does), else by calling the loss on a zero output, which is why a pair loss's count
  must depend on the target only.

The default is `cross_entropy_loss`: next-token cross-entropy summed over positions whose target is
not `IGNORE_INDEX` (-100), and their count.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

LossFn = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]
IGNORE_INDEX = -100
MEAN, PAIR = "mean", "pair"


class TokenCrossEntropy:
    """Cross-entropy summed over counted positions (target != ignore_index), and their count.

    Logits (..., vocab) are taken in fp32 whatever the compute dtype. `count(target)` gives the
    count from the target alone, so the step knows its divisor before the first backward without
    calling the loss.
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX):
        self.ignore_index = ignore_index

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, flat_target = output.flatten(0, -2), target.flatten()
        return _ChunkedCrossEntropy.apply(logits, flat_target, self.ignore_index), self.count(target)

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return (target != self.ignore_index).sum()

    def __repr__(self) -> str:
        return f"TokenCrossEntropy(ignore_index={self.ignore_index})"


cross_entropy_loss = TokenCrossEntropy()

LOSS_CHUNK_ELEMENTS = 2**24  # fp32 logits the loss holds at once (64 MiB), whatever the microbatch


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy over rows of logits, a chunk of rows at a time, never a whole fp32 copy.

    `F.cross_entropy(logits.float())` keeps an fp32 copy of the logits and their fp32 log-softmax
    for its backward (8k tokens x 128k vocabulary: 4 GB each). Here the forward sums the loss a
    chunk of rows at a time, saving nothing but the logits (the stage's output, kept for its
    backward anyway); the backward runs cross-entropy's own backward on each chunk again and writes
    it into one gradient of the logits' dtype. Rows are independent, so every gradient is exactly
    the unchunked one; only the order of the loss's fp32 sum over chunks differs.

    Under loss parallel the logits are a DTensor sharded over the vocabulary: each chunk is
    computed by torch's `loss_parallel()`, which the runtime holds around the loss and its
    backward alike, and each chunk's gradient, sharded like the logits, is written into the
    local shard of the gradient.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        ctx.ignore_index = ignore_index
        ctx.save_for_backward(logits, target)
        total = None
        for rows in _row_chunks(logits):
            chunk = F.cross_entropy(logits[rows].float(), target[rows], ignore_index=ignore_index, reduction="sum")
            total = chunk if total is None else total + chunk
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits, target = ctx.saved_tensors
        grad = torch.empty_like(logits)
        sharded = isinstance(logits, DTensor)
        local_grad = grad.to_local() if sharded else grad
        for rows in _row_chunks(logits):
            with torch.enable_grad():
                chunk = logits[rows].detach().float().requires_grad_()
                loss = F.cross_entropy(chunk, target[rows], ignore_index=ctx.ignore_index, reduction="sum")
                (chunk_grad,) = torch.autograd.grad(loss, chunk, grad_output)
            if sharded:
                chunk_grad = chunk_grad.redistribute(logits.device_mesh, logits.placements).to_local()
            local_grad[rows] = chunk_grad
        return grad, None, None


def _row_chunks(logits: torch.Tensor) -> list[slice]:
    return row_chunks(logits.shape[0], logits.shape[-1])


def row_chunks(rows: int, vocab: int) -> list[slice]:
    """Slices of `rows` rows of logits over `vocab` entries, each holding at most LOSS_CHUNK_ELEMENTS."""
    step = max(1, LOSS_CHUNK_ELEMENTS // max(vocab, 1))
    return [slice(start, start + step) for start in range(0, rows, step)] or [slice(0, 0)]


def loss_kind(result: object) -> str:
    """MEAN or PAIR for what a loss function returned; ValueError naming what is wrong otherwise."""
    if isinstance(result, torch.Tensor):
        if result.dim() != 0 or not result.is_floating_point():
            raise ValueError(
                f"loss_fn returned a {result.dtype} tensor of shape {tuple(result.shape)}; return a 0-dim floating "
                "mean, or a pair (loss_sum, count) of a 0-dim floating sum and an integer count"
            )
        return MEAN
    if isinstance(result, tuple):
        if len(result) != 2:
            raise ValueError(
                f"loss_fn returned a tuple of {len(result)} items; a pair loss returns exactly (loss_sum, count)"
            )
        loss_sum, count = result
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0 or not loss_sum.is_floating_point():
            what = (
                f"{loss_sum.dtype} tensor of shape {tuple(loss_sum.shape)}"
                if isinstance(loss_sum, torch.Tensor)
                else type(loss_sum).__name__
            )
            raise ValueError(
                f"loss_fn returned (loss_sum, count) with loss_sum a {what}; it must be a 0-dim floating tensor"
            )
        integer_tensor = (
            isinstance(count, torch.Tensor)
            and count.dim() == 0
            and not count.is_floating_point()
            and not count.is_complex()
            and count.dtype != torch.bool
        )
        if not (integer_tensor or (isinstance(count, int) and not isinstance(count, bool))):
            what = (
                f"{count.dtype} tensor of shape {tuple(count.shape)}"
                if isinstance(count, torch.Tensor)
                else f"{type(count).__name__} {count!r}"
            )
            raise ValueError(
                f"loss_fn returned (loss_sum, count) with count a {what}; the count is the number of elements "
                "loss_sum adds up: a Python int or a 0-dim integer tensor (e.g. (target != -100).sum())"
            )
        return PAIR
    raise ValueError(
        f"loss_fn returned a {type(result).__name__}; return a 0-dim floating mean, or a pair (loss_sum, count)"
    )


def check_loss_on_meta(
    loss_fn: LossFn, output: torch.Tensor, target: torch.Tensor, context: Callable[[], AbstractContextManager]
) -> str | None:
    """Run `loss_fn` on the meta output of the model and a meta target of `target`'s shape and dtype;
    return its kind (MEAN or PAIR), or None when it cannot run on meta tensors.

    A target that does not fit the output, or a result that is neither a 0-dim mean nor a
    (sum, count) pair, then fails on every rank before the step, not on the last stage's rank alone
    in the middle of the schedule. A loss that cannot run on meta tensors (class weights on a
    device, boolean masks, .item()) is classified on the last stage before the step instead.
    """
    try:
        with context(), torch.no_grad():
            result = loss_fn(output, torch.empty(target.shape, dtype=target.dtype, device="meta"))
    except Exception as error:
        # No meta kernel, data-dependent ops (.item(), masks) or real tensors mixed in: this check
        # cannot tell, the real run will. Anything else is the loss's verdict.
        if not isinstance(error, NotImplementedError) and "meta" not in str(error).lower():
            raise ValueError(
                f"loss_fn fails on the model's output {tuple(output.shape)} {output.dtype} and a target microbatch "
                f"{tuple(target.shape)} {target.dtype}: {error}"
            ) from error
        return None
    return loss_kind(result)


@torch.no_grad()
def probe_kind(
    loss_fn: LossFn, output: torch.Tensor, target: torch.Tensor, context: Callable[[], AbstractContextManager]
) -> str:
    """The kind of a loss that cannot run on meta tensors: called once on a zero output of the
    model output's layout (`output` is its meta form) and a real target; ValueError if the result
    is neither a mean nor a pair."""
    with context():
        return loss_kind(loss_fn(_zeros_like_meta(output, target.device), target))


@torch.no_grad()
def probe_counts(
    loss_fn: LossFn, output: torch.Tensor, targets: list[torch.Tensor], context: Callable[[], AbstractContextManager]
) -> list[torch.Tensor]:
    """A pair loss's count for each target microbatch, before the schedule, from the targets alone.

    A loss with a `count(target)` method is asked directly; any other is called on a zero output
    of the model output's layout (`output`, on meta), which costs one loss evaluation per
    microbatch on the last stage. Counts stay on the device (no host sync here).
    """
    counter = getattr(loss_fn, "count", None)
    if callable(counter):
        return [torch.as_tensor(counter(target), device=target.device) for target in targets]
    counts = []
    for target in targets:
        with context():
            count = loss_fn(_zeros_like_meta(output, target.device), target)[1]
        counts.append(torch.as_tensor(count, device=target.device))
    return counts


def _zeros_like_meta(output: torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(output, DTensor):
        local = torch.zeros(output.to_local().shape, dtype=output.dtype, device=device)
        return DTensor.from_local(
            local, output.device_mesh, output.placements, shape=output.shape, stride=output.stride(), run_check=False
        )
    return torch.zeros(output.shape, dtype=output.dtype, device=device)


@dataclass(frozen=True)
class LossScale:
    """How the last stage turns each microbatch's loss into what its backward starts from.

    kind MEAN: loss / microbatches. Kind PAIR: loss_sum / (global count / dp); data parallelism then
    averages over the dp ranks, which leaves sum / global count. A global count of 0 (nothing to
    count anywhere) scales by 0: loss 0 and zero gradients, never NaN.
    """

    kind: str  # MEAN or PAIR
    # MEAN: the microbatch count; PAIR: global count / dp (0 when nothing counts), a float32 tensor
    # on the device, so that no host read waits for the count
    divisor: float | torch.Tensor
    expected_count: int | torch.Tensor = 0  # PAIR: what this rank's microbatches count together, before the step
    # PAIR, when each microbatch is a minibatch of its own: its global count / dp, per microbatch
    divisors: tuple[float, ...] | torch.Tensor | None = None

    def apply(self, result: object, microbatch: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss value to report, the count it stands for, the tensor to backpropagate) of the
        step's `microbatch`-th microbatch."""
        kind = loss_kind(result)
        if kind != self.kind:
            raise ValueError(
                f"loss_fn returned a {kind} loss where an earlier call returned a {self.kind} loss; "
                "a loss must return the same kind of result for every microbatch"
            )
        if kind == MEAN:
            return _value(result), torch.ones((), device=result.device), result / self.divisor
        loss_sum, count = result
        divisor = self.divisor if self.divisors is None else self.divisors[microbatch]
        if isinstance(divisor, torch.Tensor):  # on the device: a 0 count scales by 0, tested there
            counted = divisor > 0
            scaled = loss_sum / torch.where(counted, divisor, 1.0) * counted
        else:
            scaled = loss_sum / divisor if divisor else loss_sum * 0.0
        return _value(loss_sum), torch.as_tensor(count, device=_value(loss_sum).device), scaled


def _value(loss: torch.Tensor) -> torch.Tensor:
    return (loss.to_local() if isinstance(loss, DTensor) else loss).detach().float()
