"""Bad data refused before the first message: the same verdict, and the same error, on every rank.

A token id outside the vocabulary does no good anywhere: a vocab-sharded embedding (tensor
parallel) silently maps it to a zero vector, a whole one raises on this rank only (its peers then
wait in the next message), and on CUDA it is a device-side assert that kills the process with no
message. A target outside the vocabulary hangs the vocab-parallel loss the same way. So every
step checks its batch first, where the model declares its vocabulary (a `vocab_size` int
attribute, see docs/model_protocol.md):
- token ids must have an integer dtype and lie in [0, vocab_size);
- integer targets must lie in [0, vocab_size) or equal the loss's ignore index (-100 by default);
- inputs and targets must agree in batch size, and in sequence length when both have one.
Data-parallel ranks hold different samples, so one rank may find a problem the others do not:
one all-reduce of a single flag settles whether any did (cheap: a few bytes, see
docs/performance.md), and only then are the messages gathered and the first raised on all ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mesh3d.distributed.agree import raise_if_any
from mesh3d.model.loss import IGNORE_INDEX


def declared_vocab_size(vocab_size: object) -> int | None:
    """The model's declared vocabulary (the protocol's `vocab_size` attribute, a Hugging Face
    config's `vocab_size`), checked; None when it declares none."""
    if vocab_size is None:
        return None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"parallelize: the model's vocab_size must be a positive int, got {vocab_size!r}")
    return vocab_size


def batch_problem(
    inputs: torch.Tensor, targets: torch.Tensor | None, vocab_size: int | None, ignore_index: int = IGNORE_INDEX
) -> str | None:
    """What is wrong with this rank's batch, or None. Local: no communication."""
    if targets is not None and inputs.dim() >= 1 and targets.dim() >= 1:
        sizes = min(inputs.dim(), targets.dim(), 2)  # batch, and sequence when both have one
        if tuple(inputs.shape[:sizes]) != tuple(targets.shape[:sizes]):
            what = "batch or sequence" if sizes == 2 else "batch"
            return (
                f"inputs of shape {tuple(inputs.shape)} and targets of shape {tuple(targets.shape)} differ in "
                f"{what} size; pass targets with one entry per input position"
            )
    if vocab_size is None:
        return None
    if inputs.is_floating_point() or inputs.is_complex():
        return (
            f"inputs are {inputs.dtype}, but the model takes token ids (vocab_size={vocab_size}): "
            "pass an integer tensor (torch.long)"
        )
    problem = _outside(inputs, vocab_size, "input token id")
    if problem is None and targets is not None:
        if targets.is_floating_point():
            return (
                f"targets are {targets.dtype}, but the model's targets are token ids (vocab_size={vocab_size}): "
                "pass an integer tensor (torch.long)"
            )
        problem = _outside(targets, vocab_size, "target", ignore_index)
    return problem


def _outside(ids: torch.Tensor, vocab_size: int, what: str, ignore_index: int | None = None) -> str | None:
    if ids.numel() == 0:
        return None
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if not bool(bad.any()):  # the one host sync of the check
        return None
    where = tuple(int(i) for i in bad.nonzero()[0])
    allowed = f"[0, {vocab_size})" + (f" or {ignore_index} (ignored)" if ignore_index is not None else "")
    return (
        f"{what} {int(ids[where])} at position {where} is outside {allowed}: the model's vocab_size is "
        f"{vocab_size}; check the tokenizer and the model config agree"
    )


def agree_on_batch(problem: str | None, device: torch.device, during: str) -> None:
    """Raise ValueError(f"{during}: {problem}") on every rank if any rank found a problem, else return.
    One all-reduce of one flag over the world; the messages travel only when there is one."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([problem is not None], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
    raise_if_any(f"{during}: bad batch: {problem}" if problem else None)
