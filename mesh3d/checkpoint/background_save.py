"""async_save: a checkpoint written in a background thread while training goes on.

What the caller waits for is what must happen on every rank at the call: the checks and the
agreement, the directory prepared (saving.prepare), and a host copy of the state (staging.py). The
write, the checksums and rank 0's publication run in one thread per rank (saving.write_and_publish),
every collective of it on a gloo group over the world that the first async_save creates (on every
rank, in the same order) and the later ones reuse: two threads' collectives on one group would
interleave with the training step's.

One save at a time: `async_save`, `save` and `load` first wait for the save in flight
(`finish_previous`) and raise its failure if nobody was told of it yet. The thread is not a daemon:
a process whose main thread ends waits for the save in flight (as torch's own async_save does).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mesh3d.checkpoint.saving import prepare, write_and_publish
from mesh3d.checkpoint.staging import HostCopy
from mesh3d.checkpoint.strided_entries import as_checkpointable, deliberate_sharded_tensors
from mesh3d.distributed.agree import attempt, raise_if_any
from mesh3d.parallel_model import ParallelModel


class AsyncSave:
    """A checkpoint being written in the background: returned by `async_save`.

    `wait()` blocks until it is written, checksummed and published, and returns its path, or
    raises its failure (the same on every rank); `done()` says, without blocking, whether the
    write has ended (published or failed). `path` is the checkpoint's directory.
    """

    def __init__(self, path: str, write: Callable[[], object]) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._told = False  # whether wait() has raised the failure to the caller
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"mesh3d async_save {path}")
        self._thread.start()

    def _run(self, write: Callable[[], object]) -> None:
        try:
            write()
        except BaseException as error:  # noqa: BLE001 - handed to wait(), on the caller's thread
            self._error = error

    def done(self) -> bool:
        """True once the write has ended, published or failed (then `wait()` raises at once)."""
        return not self._thread.is_alive()

    def wait(self) -> str:
        """Block until the checkpoint is published and return its path; raise what failed instead
        (on every rank: the write's collectives agree on it), each time it is called."""
        self._thread.join()
        if self._error is not None:
            self._told = True
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "writing" if not self.done() else "failed" if self._error is not None else "published"
        return f"AsyncSave({self.path!r}, {state})"


_in_flight: AsyncSave | None = None
_host_copy = HostCopy()
_writer_group: tuple[dist.ProcessGroup, object] | None = None  # the group, and the default group it was made in


def finish_previous() -> None:
    """Wait for the save in flight, if any, and raise its failure unless its wait() already did."""
    global _in_flight
    previous, _in_flight = _in_flight, None
    if previous is not None:
        previous._thread.join()
        if previous._error is not None and not previous._told:
            previous.wait()


def _group(timeout) -> dist.ProcessGroup:
    """The background writes' gloo group over the world: made by the first call on every rank (new_group
    is collective) while the default group stands, then reused."""
    global _writer_group
    if _writer_group is None or _writer_group[1] is not dist.group.WORLD:
        _writer_group = (dist.new_group(backend="gloo", timeout=timeout), dist.group.WORLD)
    return _writer_group[0]


def async_save(
    path: str | os.PathLike,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    data_state: Any = None,
    extra: Any = None,
    keep_last: int | None = None,
    writer_threads: int = 1,
    before_publish: Callable[[Path], None] | None = None,
    checksums: bool = True,
) -> AsyncSave:
    """Save as `checkpoint.save` does (the same arguments and checkpoint), writing in the background.
    Call on every rank; training may go on at once.

    Before it returns, on every rank: the save in flight, if any, is waited for (its failure raised
    if it failed and nobody waited for it); the arguments and weights are checked and agreed on
    (bad input raises here on every rank, as `save` raises it); the directory is prepared; and
    model, optimizer state, kept never-drain versions, RNG states, data_state, extra and step are
    copied to host memory (pinned on CUDA), so the steps taken meanwhile do not change what is
    saved. That copy, one of the rank's checkpointed state, is kept and refilled by the next
    async_save of the same shapes.

    The write, the checksums and rank 0's publication (`before_publish` included, called in that
    thread) then run in a background thread per rank, on a process group of their own. The
    checkpoint appears under `path` only once complete: a process killed meanwhile leaves the
    previous checkpoint the newest. Call `wait()` on the handle before the process exits or
    destroys its process group.

    Returns an AsyncSave: `wait()` returns the path once published, or raises on every rank what
    `save` would have raised (a failed write's OSError or CheckpointException, a ValueError from
    before_publish or the publication); `done()` does not block.
    """
    global _in_flight
    finish_previous()
    path = Path(path)
    prepared = prepare(
        path,
        pm,
        optimizer,
        step=step,
        data_state=data_state,
        extra=extra,
        keep_last=keep_last,
        writer_threads=writer_threads,
        before_publish=before_publish,
        checksums=checksums,
    )
    group = _group(pm.layout.timeout)
    staged = {}  # a copy that failed on one rank (out of memory) fails on all: none starts a thread
    raise_if_any(attempt(lambda: staged.update(_host_copy.stage(prepared.entries, pm.layout.device))))
    prepared.entries = {}  # the live tensors are not needed any more; the thread writes the copy
    with deliberate_sharded_tensors():  # here, not in the thread: warnings' filters are not thread-safe
        checkpointable = as_checkpointable(staged)
    _in_flight = AsyncSave(str(path), lambda: write_and_publish(prepared, checkpointable, group))
    return _in_flight
