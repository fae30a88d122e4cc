"""An error every rank raised alike is printed once, by rank 0.

When the ranks agree on an error (agree.py: one rank's failure raised on every rank), each rank's
Python would print the same traceback: eight copies under `torchrun --nproc-per-node 8`, the
message lost among them. `agreed(error)` marks such an error (an attribute: its type and errno
stay as they are), and the hook build_mesh installs prints it in full on rank 0 only; every other
rank says in one line that it stopped on the error rank 0 printed, and the rank that found it (a bad
batch only it held, marked `(found on rank R)` in rank 0's text) says it found it. `raised_alike()` marks the
errors of checks each rank makes alike from the same arguments, before any collective. Any other
exception is printed as Python prints it, on every rank.
MESH3D_TRACEBACK_EVERY_RANK=1 prints every rank's in full.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from types import TracebackType

AGREED = "mesh3d_agreed_on_every_rank"  # the attribute that marks an error every rank raised alike
FOUND_ON = "mesh3d_found_on_rank"  # the rank whose check failed, where the agreement knows it


def agreed(error: BaseException, found_on: int | None = None) -> BaseException:
    """Mark `error` as raised alike on every rank (its type unchanged: a ValueError stays one);
    `found_on`: the rank whose check failed, when one rank's failure was raised everywhere."""
    setattr(error, AGREED, True)
    if found_on is not None:
        setattr(error, FOUND_ON, found_on)
    return error


def stopped_line(kind: type[BaseException], error: BaseException, rank: int) -> str:
    """What rank `rank` (not 0) prints instead of the traceback of an agreed error."""
    if getattr(error, FOUND_ON, None) == rank:  # its own finding: rank 0 printed it, but did not find it
        return f"[rank {rank}] stopped on the {kind.__name__} it found, which rank 0 printed"
    return f"[rank {rank}] stopped on the {kind.__name__} that rank 0 printed"


@contextlib.contextmanager
def raised_alike() -> Iterator[None]:
    """Mark a ValueError or TypeError raised inside as agreed: for checks every rank computes from the
    same arguments, before any collective (parallelize's arithmetic on its keywords), so each rank
    raises the same error without asking the others."""
    try:
        yield
    except (ValueError, TypeError) as error:
        agreed(error)
        raise


def _hook(previous, rank: int):
    def hook(kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
        every_rank = os.environ.get("MESH3D_TRACEBACK_EVERY_RANK") == "1"
        if rank != 0 and getattr(error, AGREED, False) and not every_rank:
            print(stopped_line(kind, error, rank), file=sys.stderr, flush=True)
            return
        previous(kind, error, traceback)

    hook.mesh3d_printed_once = True
    return hook


def print_agreed_errors_once(rank: int) -> None:
    """Install the hook (once per process) for this process' rank."""
    if getattr(sys.excepthook, "mesh3d_printed_once", False):
        return
    sys.excepthook = _hook(sys.excepthook, rank)
