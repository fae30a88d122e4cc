"""A peer that stops answering becomes an error that says so, on every rank that waits for it.

The process groups' timeout (`build_mesh(timeout=...)`) bounds every wait. On gloo a P2P
`work.wait()` and every collective raise when it runs out. On NCCL a wait is a stream wait and
the watchdog ends the process (nccl_watchdog.py); what reaches Python is an operation on a
communicator that was aborted, or a peer's failure NCCL reports. What comes out is a backend
error ("Timed out waiting 10000ms for recv operation", "Connection reset by peer" once the peer's
own process has failed, "NCCL communicator was aborted on rank 3") that names neither the wait nor
the rank. Here such an error is recognized and raised again as `PeerTimeout`, with what was
waiting (the P2P message, or the collective) and this rank's mesh coordinates, so a user reading
any rank's log learns which rank to look at.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

from torch.distributed import DistNetworkError

# Substrings of the errors gloo and NCCL raise when a peer stops answering or its process is gone.
_TIMEOUT_SIGNS = (
    "timed out",
    "timeout",
    "connection reset",
    "connection closed",
    "connection refused",
    "pair closure",
    "broken pipe",
    "watchdog",
    # NCCL (ProcessGroupNCCL and NCCL's own result texts): an operation on a communicator the
    # watchdog aborted, a peer's process gone, a network failure.
    "nccl communicator was aborted",
    "ncclremoteerror",
    "remote process exited or there was a network error",
    "some nccl operations have failed or timed out",
)


class PeerTimeout(RuntimeError):
    """A collective or P2P wait on this rank did not complete within the process-group timeout
    (or its peer's process went away while it waited)."""

    def __init__(self, message: str, waiting_for: str):
        super().__init__(message)
        self.waiting_for = waiting_for


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error` is a backend's report of a wait that timed out or lost its peer (not every
    NCCL error: "invalid usage" or "unhandled cuda error" are this rank's own)."""
    if isinstance(error, DistNetworkError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(sign in text for sign in _TIMEOUT_SIGNS)


@contextlib.contextmanager
def waiting_for(what: str) -> Iterator[None]:
    """Inside: a wait for `what` ("the activation of stage 2, microbatch 1 from global rank 3").
    A timeout there is raised as PeerTimeout naming it (`located` adds the mesh coordinates)."""
    try:
        yield
    except PeerTimeout:
        raise
    except RuntimeError as error:
        if not is_peer_failure(error):
            raise
        raise PeerTimeout(f"{what}: {error}", what) from error


@contextlib.contextmanager
def located(rank: int, coordinate: tuple[int, int, int], timeout: timedelta, during: str) -> Iterator[None]:
    """Inside: `during` (e.g. "pm.step") on this rank. A peer failure there (a PeerTimeout from a
    P2P wait, or a collective's timeout) is raised as PeerTimeout that says which rank, where in
    the mesh, after how long, and what waited."""
    try:
        yield
    except RuntimeError as error:
        if not (isinstance(error, PeerTimeout) or is_peer_failure(error)):
            raise
        what = (
            error.waiting_for
            if isinstance(error, PeerTimeout)
            else "a collective (data- or tensor-parallel, or the loss's)"
        )
        names = ("pp", "dp", "tp") if len(coordinate) == 3 else ("pp", "dp", "cp", "tp")
        where = ", ".join(f"{name} {value}" for name, value in zip(names, coordinate))
        raise PeerTimeout(
            f"rank {rank} (mesh coordinate {where}): a peer did not answer within the "
            f"process-group timeout of {timeout.total_seconds():g} s while this rank waited for {what} in {during}. "
            "A rank is stopped, stuck or dead: look at the ranks that did not report this error. Backend error: "
            f"{error.__cause__ or error}",
            what,
        ) from error
