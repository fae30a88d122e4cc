"""Per-sample inputs checked like the tokens: the tensors a step is given besides them
(`pm.step(inputs, targets, position_ids=..., document_ids=...)`), refused on every rank before
any message.

Each must be a tensor whose first dimension is the batch (it is split into microbatches with the
tokens). One the model declares an index (`input_index_bounds`, model/stage_inputs.py: position
ids index the rotary table) must also be an integer tensor of the tokens' (batch, sequence) shape
with values in [0, n). The verdict has batch_check.py's form, so both travel in the batch's one
all-reduce: a message found from shapes, dtypes or host values, or a flag on the device.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from mesh3d.step.batch_check import agree_on_batch, batch_problem, batch_verdict


def check_batch(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    per_sample: dict[str, object],
    vocab_size: int | None,
    ignore_index: int,
    bounds: dict[str, int],
    during: str,
    first_row: int = 0,
) -> None:
    """The tokens, targets and per-sample inputs checked together: one verdict per rank, agreed in
    the step's one all-reduce (batch_check.py), raised on every rank if any rank found a problem.
    A bad token's position is named in the global batch, whose rows `first_row` on are this rank's."""
    verdict = _either(  # on the host copies, before any transfer
        batch_verdict(inputs, targets, vocab_size, ignore_index, first_row),
        per_sample_verdict(inputs, per_sample, bounds),
    )
    agree_on_batch(
        verdict,
        during,
        lambda: (
            batch_problem(inputs, targets, vocab_size, ignore_index, first_row)
            or per_sample_problem(inputs, per_sample, bounds)
        ),
    )


def per_sample_verdict(
    inputs: torch.Tensor, per_sample: dict[str, object], bounds: dict[str, int]
) -> str | torch.Tensor | None:
    """This rank's verdict on its per-sample inputs, with no device-to-host read: None (fine), what
    is wrong, or a 0-dim bool tensor on the device saying whether an index there is out of range."""
    batch = inputs.shape[0] if inputs.dim() else 0
    flags = []
    for name, value in per_sample.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            what = "a 0-dim tensor" if isinstance(value, torch.Tensor) else type(value).__name__
            return (
                f"per-sample input {name!r} is {what}; pass a tensor whose first dimension is the batch "
                f"({batch} samples, as the tokens)"
            )
        if value.shape[0] != batch:
            return (
                f"per-sample input {name!r} of shape {tuple(value.shape)} holds {value.shape[0]} samples, the "
                f"tokens of shape {tuple(inputs.shape)} hold {batch}; pass one row per sample (dim 0)"
            )
        if name not in bounds:
            continue
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            return (
                f"per-sample input {name!r} is {value.dtype}, but it is an index: pass an integer tensor (torch.long)"
            )
        if tuple(value.shape) != tuple(inputs.shape[:2]):
            return (
                f"per-sample input {name!r} has shape {tuple(value.shape)}; it is an index per token: pass the "
                f"tokens' shape {tuple(inputs.shape[:2])}"
            )
        if value.device.type == "cpu":  # the host copy, before its transfer: read through numpy
            problem = _outside_on_host(name, value.numpy(), bounds[name])
            if problem is not None:
                return problem
        elif value.numel():
            flags.append(((value < 0) | (value >= bounds[name])).any())
    return torch.stack(flags).any() if flags else None


def per_sample_problem(inputs: torch.Tensor, per_sample: dict[str, object], bounds: dict[str, int]) -> str | None:
    """What is wrong with this rank's per-sample inputs, or None (reads device values back: only on
    the way to an error)."""
    verdict = per_sample_verdict(inputs, per_sample, bounds)
    if not isinstance(verdict, torch.Tensor):
        return verdict
    for name, bound in bounds.items():
        if name in per_sample:
            problem = _outside_on_host(name, per_sample[name].cpu().numpy(), bound)
            if problem is not None:
                return problem
    return None


def _either(first: str | torch.Tensor | None, second: str | torch.Tensor | None) -> str | torch.Tensor | None:
    """Two verdicts as one: a message wins, two device flags become one."""
    if isinstance(first, str) or second is None:
        return first if first is not None else second
    if isinstance(second, str) or first is None:
        return second
    return first | second


def _outside_on_host(name: str, ids: np.ndarray, bound: int) -> str | None:
    bad = (ids < 0) | (ids >= bound)
    if not bad.any():
        return None
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    return (
        f"per-sample input {name!r} holds {int(ids[where])} at position {where}, outside [0, {bound}): the "
        f"model's input_index_bounds allow {name} in [0, {bound}); check the data, or build the model larger"
    )


def check_split(inputs: torch.Tensor, microbatches: int, tp: int, sequence_parallel: bool, cp: int = 1) -> None:
    """The batch splits into `microbatches` equal ones (dim 0), and under sequence parallelism its
    sequence (dim 1) over tp; the same shapes on every rank give the same verdict, so no message.
    Under context parallelism `inputs` are a rank's tokens of each sequence (1/cp of it)."""
    if inputs.dim() == 0 or inputs.shape[0] % microbatches != 0:
        raise ValueError(
            f"a batch of {inputs.shape[0] if inputs.dim() else 0} samples does not split into "
            f"microbatches={microbatches} equal microbatches (dim 0); use a batch size that is a multiple of "
            f"{microbatches}"
        )
    if sequence_parallel and (inputs.dim() < 2 or inputs.shape[1] % tp != 0):
        if cp > 1:
            whole, step = inputs.shape[1] * cp, math.lcm(2 * cp, cp * tp)
            raise ValueError(
                f"sequence length {whole} gives each of the cp={cp} ranks {inputs.shape[1]} tokens, which the tp "
                f"plan's sequence parallel cannot split over tp={tp}; use a sequence length that is a multiple of "
                f"{step}"
            )
        raise ValueError(
            f"sequence length {inputs.shape[1] if inputs.dim() >= 2 else None} is not divisible by tp={tp}; the tp "
            f"plan uses sequence parallel, which splits dim 1 over the tp ranks: use a multiple of {tp}"
        )
