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
one all-reduce of a single flag over the host group settles whether any did (cheap: a few bytes,
see docs/performance.md), and only then are the messages gathered and the first raised on all
ranks. A batch still on the host (as a loader gives it) is checked there, through numpy, before
its transfer, and its flag travels in host memory (gloo, under NCCL too): the check waits for no
device. Ids given already on a device cost one read of their flag.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mesh3d.distributed.agree import any_rank, raise_if_any
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
    inputs: torch.Tensor,
    targets: torch.Tensor | None,
    vocab_size: int | None,
    ignore_index: int = IGNORE_INDEX,
    first_row: int = 0,
) -> str | None:
    """What is wrong with this rank's batch, or None. Local: no communication (ids on a device are
    read back to the host: use `batch_verdict` on the hot path). A position is named in the global
    batch: this rank's rows are its rows `first_row` on."""
    verdict = batch_verdict(inputs, targets, vocab_size, ignore_index, first_row)
    if isinstance(verdict, torch.Tensor):
        return _explain_on_device(inputs, targets, vocab_size, ignore_index, first_row) if bool(verdict) else None
    return verdict


def batch_verdict(
    inputs: torch.Tensor,
    targets: torch.Tensor | None,
    vocab_size: int | None,
    ignore_index: int = IGNORE_INDEX,
    first_row: int = 0,
) -> str | torch.Tensor | None:
    """This rank's verdict on its batch, with no device-to-host read: None (fine), what is wrong
    (found from shapes and dtypes, or from ids on the host), or, for ids already on a device, a
    0-dim bool tensor there saying whether one is out of range (`agree_on_batch` reads it with
    its peers' flags). A position is named in the global batch, this rank's rows being its rows
    `first_row` on (the dp rank times the rows per rank, as DistributedLoader deals them)."""
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
    if targets is not None and targets.is_floating_point():
        return (
            f"targets are {targets.dtype}, but the model's targets are token ids (vocab_size={vocab_size}): "
            "pass an integer tensor (torch.long)"
        )
    checks = [(inputs, "input token id", None)] + ([(targets, "target", ignore_index)] if targets is not None else [])
    on_device = [(ids, ignore) for ids, _, ignore in checks if ids.device.type != "cpu" and ids.numel()]
    for ids, what, ignore in checks:
        if ids.device.type == "cpu":  # the host copy, before its transfer: read through numpy, no device waits
            problem = _outside_on_host(ids.numpy(), vocab_size, what, ignore, first_row)
            if problem is not None:
                return problem
    if not on_device:
        return None
    return torch.stack([_out_of_range(ids, vocab_size, ignore).any() for ids, ignore in on_device]).any()


def _out_of_range(ids, vocab_size: int, ignore_index: int | None):
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore_index is not None:
        bad &= ids != ignore_index
    return bad


def _message(
    what: str, value: int, where: tuple[int, ...], vocab_size: int, ignore_index: int | None, first_row: int
) -> str:
    allowed = f"[0, {vocab_size})" + (f" or {ignore_index} (ignored)" if ignore_index is not None else "")
    position = (where[0] + first_row, *where[1:]) if where else where  # (row, ...) in the global batch
    return (
        f"{what} {value} at position {position} is outside {allowed}: the model's vocab_size is "
        f"{vocab_size}; check the tokenizer and the model config agree"
    )


def _outside_on_host(
    ids: np.ndarray, vocab_size: int, what: str, ignore_index: int | None, first_row: int
) -> str | None:
    bad = _out_of_range(ids, vocab_size, ignore_index)
    if not bad.any():
        return None
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    return _message(what, int(ids[where]), where, vocab_size, ignore_index, first_row)


def _explain_on_device(
    inputs: torch.Tensor, targets: torch.Tensor | None, vocab_size: int, ignore_index: int, first_row: int
) -> str | None:
    """The message for ids on a device found out of range (reads them back: only on the way to an error)."""
    checks = [(inputs, "input token id", None)] + ([(targets, "target", ignore_index)] if targets is not None else [])
    for ids, what, ignore in checks:
        bad = _out_of_range(ids, vocab_size, ignore)
        if ids.numel() and bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            return _message(what, int(ids[where]), where, vocab_size, ignore, first_row)
    return None


def agree_on_batch(
    verdict: str | torch.Tensor | None,
    during: str,
    explain: Callable[[], str | None] = lambda: None,
) -> None:
    """Raise ValueError(f"{during}: ...") on every rank if any rank found a problem, else return.

    `verdict` is `batch_verdict`'s; `explain()` gives the message of a device flag that is set.
    The ranks agree over the host group (`any_rank`: one int in host memory, gloo under NCCL too),
    so a batch given on the host, as a loader gives it, is checked and agreed on with no device
    waited for; ids given on a device are read once here (their flag: one host sync). The messages
    travel only when there is one."""
    found = bool(verdict) if isinstance(verdict, torch.Tensor) else verdict is not None
    if not any_rank(found):
        return
    if isinstance(verdict, torch.Tensor):
        verdict = explain() if found else None
    raise_if_any(f"{during}: bad batch: {verdict}" if verdict else None)
