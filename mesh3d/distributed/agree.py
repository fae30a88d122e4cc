"""Every rank agrees, or every rank raises.

A check that fails on one rank only (a different argument, a full disk, a bad file) must fail on
all of them: a rank that raises alone leaves the others waiting in the next collective until the
process-group timeout. Each helper here is one small all-gather over the world (a barrier too),
on the CPU: over the default process group, or the gloo side group when the backend is NCCL
(host_group.py), or the group a caller passes (a checkpoint written in a background thread agrees on
a group of its own: two threads' collectives on one group would interleave); with one process it
sends nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mesh3d.distributed.dry_world import answers_alone
from mesh3d.distributed.host_group import host_group
from mesh3d.distributed.printed_once import agreed


class ErrorText(str):
    """An error's text that keeps its errno, when it was an OSError (a full disk stays ENOSPC)."""

    errno: int | None = None


def attempt(fn: Callable[[], object]) -> str | None:
    """Run fn on this rank; its exception as text (for `raise_if_any`), or None."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - every rank must learn of it, not only this one
        text = ErrorText(f"{type(error).__name__}: {error}")
        text.errno = error.errno if isinstance(error, OSError) else None
        return text
    return None


def gather_or_raise(value: Any = None, error: str | None = None, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `value`, in rank order; or, if any rank passed an `error`, that error raised
    on every rank (the first failing rank's, marked with where it was found): an OSError with
    its errno when `attempt` caught one, else a ValueError (marked agreed: printed once, by
    rank 0, printed_once.py). Over `group` (a CPU group spanning
    the world) when given, else over host_group()."""
    mine = (value, error)
    everyone = [mine]
    if answers_alone():  # a dry run: every rank said what this one says (dry_world.py)
        everyone = [mine] * dist.get_world_size()
    elif dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine, group=group if group is not None else host_group())
    here = dist.get_rank() if dist.is_initialized() else 0
    for rank, (_, message) in enumerate(everyone):
        if message:
            text = message if rank == here else f"{message} (found on rank {rank})"
            code = getattr(message, "errno", None)
            if code is None:
                raise agreed(ValueError(text), found_on=rank)
            error = OSError(text)
            error.errno = code
            raise agreed(error, found_on=rank)
    return [v for v, _ in everyone]


def raise_if_any(error: str | None, group: dist.ProcessGroup | None = None) -> None:
    """Raise the first failing rank's error on every rank; return on every rank if none failed."""
    gather_or_raise(None, error, group)


def any_rank(found: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Whether `found` is True on any rank, the same answer on every rank: one all-reduce of one
    int32 in host memory over `group` (else host_group(): gloo under NCCL too), read back through
    numpy, so no device is waited for. With one process it sends nothing."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return found
    flag = torch.tensor([int(found)], dtype=torch.int32)  # host memory on every backend: the host group is gloo
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group if group is not None else host_group())
    return bool(flag.numpy()[0])


def check_same_everywhere(value: Any, describe: Callable[[list[Any]], str]) -> None:
    """Raise ValueError(describe(every rank's value)) on every rank unless all ranks passed equal values."""
    everyone = gather_or_raise(value)
    if any(v != everyone[0] for v in everyone):
        raise agreed(ValueError(describe(everyone)))


def from_first_rank(compute: Callable[[], Any], meanwhile: Callable[[], object] | None = None) -> Any:
    """compute()'s result, run on rank 0 alone and handed to every rank (one all-gather over
    host_group()): for work every rank would repeat to the same end; the other ranks run
    `meanwhile` instead. If it raises anywhere, every rank raises the first failing rank's error:
    its own where it failed, elsewhere one of the same type rebuilt from its text (a ValueError stays
    one; a type that cannot be rebuilt so, a RuntimeError), marked agreed. compute's error reads
    the same on every rank, as when each rank computed it; one of `meanwhile` names its rank. With
    one process it sends nothing."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or answers_alone():
        return compute()  # alone, or a dry run: this rank is its own first rank (dry_world.py)
    here = dist.get_rank()
    outcome, failure = None, None
    try:
        outcome = compute() if here == 0 else (meanwhile() if meanwhile is not None else None)
    except Exception as error:  # noqa: BLE001 - raised below on every rank, once each has taken part
        failure = error
    mine = (outcome if here == 0 else None, None if failure is None else _told(failure))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=host_group())
    for rank, (_, told) in enumerate(everyone):
        if told is not None:
            if rank == here:
                raise agreed(failure, found_on=rank)
            raise agreed(_rebuilt(*told, f" (found on rank {rank})" if rank else ""), found_on=rank) from failure
    return everyone[0][0]


def _told(error: Exception) -> tuple[type | None, str, str]:
    """What travels of an error: its type where every rank can unpickle it (a builtin one), its name
    and its text."""
    kind = type(error)
    return (kind if kind.__module__ == "builtins" else None), kind.__name__, str(error)


def _rebuilt(kind: type | None, name: str, text: str, where: str) -> Exception:
    if kind is not None:
        try:
            return kind(text + where)
        except Exception:  # noqa: BLE001 - a builtin type whose constructor takes other arguments
            pass
    return RuntimeError(f"{name}: {text}{where}")
