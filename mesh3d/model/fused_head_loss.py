"""The output head and the cross-entropy as one computation, a chunk of rows at a time
(`parallelize(fused_loss=True)`): the logits of a microbatch never exist whole.

Unfused, the last stage's head writes every token's logits (8k tokens x a 128k vocabulary: 2 GiB in
bf16), autograd keeps them for the loss's backward, and the backward writes their gradient as large.
Fused, the head's forward, given the microbatch's targets, runs head and loss on a chunk of rows at
a time and keeps only its input; its backward recomputes each chunk's logits, and turns their
gradient into the chunk's input gradient and a share of the weight's at once. Rows are independent:
every logit, loss term and input gradient is the unfused one's; the weight's gradient is summed over
chunks in fp32 (one matmul sums over all rows in one pass), so it differs by rounding only.

The runtime hands the last stage its targets (`head_targets`, pipeline/stage_compute.py); the head
then returns the microbatch's summed loss, which `FusedCrossEntropy` passes on with its count, only
if it is that very tensor (a model that did arithmetic on its head's output would otherwise train on
a transformed loss). Called without targets (outside a step) the head is a plain linear layer.
Selective checkpointing caches no chunk's logits (`computing_fused_head`).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mesh3d.model.loss import IGNORE_INDEX, cross_entropy_loss, row_chunks

# transformers' causal LMs whose lm_head output is the logits as they are (no scaling or softcapping
# after it): tests/unit/test_fused_head_loss.py checks each against its unfused loss.
FUSED_HEAD_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")
HEAD_NAMES = ("output", "lm_head")  # the mesh3d protocol's head, transformers'

_TARGETS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("mesh3d_head_targets", default=None)
_IN_CHUNKS: contextvars.ContextVar[bool] = contextvars.ContextVar("mesh3d_fused_head_chunks", default=False)
_returned: list = [None]  # a weak reference to the loss the fused head returned last


class FusedCrossEntropy:
    """The loss under `fused_loss=True`: the head already summed the microbatch's cross-entropy
    (`output`); this returns it with the count of counted targets, as the default loss does."""

    def __init__(self, ignore_index: int = IGNORE_INDEX):
        self.ignore_index = ignore_index

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if output.dim() == 0 and not output.is_meta and (_returned[0] is None or _returned[0]() is not output):
            raise RuntimeError(
                "fused_loss: the last stage's output is not the loss its fused head returned: the model's forward "
                "computes something from its head's output (a scale, a softcap, a slice), which the fused head "
                "cannot take into the loss; pass fused_loss=False"
            )
        if output.dim() != 0:
            if not output.is_meta:
                raise RuntimeError(
                    f"fused_loss: the last stage returned an output of shape {tuple(output.shape)}, not the loss its "
                    "fused head computes; the head ran without the microbatch's targets (called outside pm.step "
                    "and pm.evaluate?)"
                )
            # the meta output of the stage's unfused meta copy (loss.py checks the loss's kind on it)
            output = output.float().sum() * 0
        return output, self.count(target)

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return (target != self.ignore_index).sum()

    def __repr__(self) -> str:
        return f"FusedCrossEntropy(ignore_index={self.ignore_index})"


fused_cross_entropy = FusedCrossEntropy()


def check_fused_loss(fused_loss: bool, model: nn.Module, loss_fn: object, tp: int, traced: bool) -> None:
    """ValueError (alike on every rank, before any collective) where the fused head cannot stand in
    for the head and the default loss exactly."""
    if not isinstance(fused_loss, bool):
        raise ValueError(f"parallelize: fused_loss must be True or False, got {fused_loss!r}")
    if not fused_loss:
        return
    refusal = None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    head = head_of(model)
    if loss_fn is not None and loss_fn is not cross_entropy_loss:
        refusal = f"a loss_fn was given ({loss_fn!r}); the fused head computes the default cross-entropy only"
    elif tp > 1:
        refusal = (
            f"tp={tp} shards the head over the vocabulary, and the fused head needs every logit of a row on one "
            "rank; at tp > 1 use loss_parallel=True for the same saving of memory"
        )
    elif traced:
        refusal = "a traced model's head is not a module mesh3d can find"
    elif model_type is not None and model_type not in FUSED_HEAD_MODEL_TYPES:
        refusal = (
            f"its model_type {model_type!r} is not one whose head output is the logits as they are "
            f"(checked for {', '.join(FUSED_HEAD_MODEL_TYPES)})"
        )
    elif head is None:
        refusal = f"it has no nn.Linear head named {' or '.join(repr(n) for n in HEAD_NAMES)}"
    elif type(head).forward is not nn.Linear.forward:
        refusal = (
            f"its head is a {type(head).__name__} with a forward of its own, which the fused head would replace "
            "by nn.Linear's"
        )
    if refusal is not None:
        raise ValueError(f"parallelize: fused_loss=True cannot be used here: {refusal}; or pass fused_loss=False")


def head_of(module: nn.Module) -> nn.Linear | None:
    """The output head a (stage) module holds at its top level, or None."""
    for name in HEAD_NAMES:
        head = getattr(module, name, None)
        if isinstance(head, nn.Linear):
            return head
    return None


def fuse_head(stage: nn.Module) -> None:
    """Make the last stage's head compute the loss when the runtime gives it targets. The module
    stays what it was (its parameters keep their names, FSDP's hooks around the stage still gather
    them): only its forward is replaced."""
    head = head_of(stage)
    if head is None:
        raise ValueError(f"fused_loss: the last stage ({type(stage).__name__}) holds no head named {HEAD_NAMES}")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        target = _TARGETS.get()
        if target is None:
            return F.linear(hidden, head.weight, head.bias)
        rows = hidden.flatten(0, -2)
        if rows.shape[0] != target.numel():
            raise ValueError(
                f"fused_loss: the head got {rows.shape[0]} rows and the microbatch has {target.numel()} targets "
                f"(targets {tuple(target.shape)}); the fused head needs one target a row, as the default loss does"
            )
        loss = _LinearCrossEntropy.apply(rows, head.weight, head.bias, target.flatten(), IGNORE_INDEX)
        _returned[0] = weakref.ref(loss)
        return loss

    head.forward = forward


def computing_fused_head() -> bool:
    """Whether a fused head's chunks are being computed: selective checkpointing caches no matmul
    result then (pipeline/activation_checkpoint.py), or it would hold every chunk's logits."""
    return _IN_CHUNKS.get()


@contextlib.contextmanager
def head_targets(target: torch.Tensor | None) -> Iterator[None]:
    """The targets a fused head computes the loss against, for the forward run inside."""
    token = _TARGETS.set(target)
    try:
        yield
    finally:
        _TARGETS.reset(token)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(rows @ weight.T + bias), a chunk of rows at a time (loss.py's
    chunks), in the dtype the head runs in and the loss taken in fp32, as unfused."""

    @staticmethod
    def forward(ctx, rows, weight, bias, target, ignore_index):
        ctx.ignore_index = ignore_index
        ctx.save_for_backward(rows, weight, bias, target)
        total = None
        token = _IN_CHUNKS.set(True)
        try:
            for chunk in row_chunks(rows.shape[0], weight.shape[0]):
                logits = F.linear(rows[chunk], weight, bias)
                part = F.cross_entropy(logits.float(), target[chunk], ignore_index=ignore_index, reduction="sum")
                total = part if total is None else total + part
        finally:
            _IN_CHUNKS.reset(token)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        rows, weight, bias, target = ctx.saved_tensors
        grad_rows = torch.empty_like(rows)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        for chunk in row_chunks(rows.shape[0], weight.shape[0]):
            with torch.enable_grad():
                logits = F.linear(rows[chunk], weight, bias).detach().float().requires_grad_()
                loss = F.cross_entropy(logits, target[chunk], ignore_index=ctx.ignore_index, reduction="sum")
                (grad_logits,) = torch.autograd.grad(loss, logits, grad_output)
            grad_logits = grad_logits.to(rows.dtype)  # as the unfused loss writes the logits' gradient
            grad_rows[chunk] = grad_logits @ weight
            grad_weight += _in_fp32(grad_logits.t(), rows[chunk])
            if grad_bias is not None:
                grad_bias += grad_logits.float().sum(0)
        return (
            grad_rows,
            grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
        )


def _in_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and returned in fp32, whatever their dtype: the weight's gradient is a sum
    over chunks, rounded to its dtype once, as one matmul over every row would round it."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()
