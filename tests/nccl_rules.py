"""NCCL's rules for point-to-point traffic, enforced over gloo: the suite's ranks run under them.

ProcessGroupNCCL runs every operation a rank issues on one communicator on that communicator's
stream, so, unlike gloo:

1. **one FIFO per communicator per rank**: an operation starts only once every earlier operation
   this rank issued on that communicator has completed;
2. **a send completes only once its receive is posted** there, at the head of the receiver's
   FIFO (gloo's own rendezvous gives this, once rule 1 holds: a gloo send waits for its receive);
3. **messages pair by order**: the n-th send from A to B on a communicator lands in B's n-th
   receive from A, whatever the tags say (NCCL has none).

gloo forgives all three: it runs operations side by side and pairs messages by tag, so a list that
deadlocks or mispairs on NCCL can pass on gloo. `install()` (done in every rank that
`multiprocess.run_on_ranks` starts under pytest, unless `MESH3D_NCCL_RULES=0`; a bench script
measures plain gloo unless `MESH3D_NCCL_RULES=1`) wraps torch.distributed's
point-to-point calls and its collectives (a tie's all-reduce on a pipeline channel waits behind
the channel's messages, say), so that each communicator of a rank has one worker thread running
its operations one after another, each waited on before the next starts, and every message goes
to gloo with a tag that is its number in its (communicator, sender, receiver) order (rule 3), the
caller's tag kept only for the log. The collectives torch's DTensor and FSDP issue from C++ go to
gloo directly, on the mesh's groups, which carry no message; they keep their order among the
wrapped ones, since a wrapped collective is waited on before its caller goes on (mesh3d issues
none asynchronously).

A wait that outlasts `MESH3D_NCCL_RULES_TIMEOUT` seconds (default 240) raises `NCCLOrderDeadlock`
naming the communicator, the operation at its head and what is queued behind it: on NCCL the same
lists would hang. `issued()` gives this rank's operations per communicator in issue order, for
tests that compare them with the lowered lists.
"""

from __future__ import annotations

import collections
import inspect
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ENV = "MESH3D_NCCL_RULES"
TIMEOUT_ENV = "MESH3D_NCCL_RULES_TIMEOUT"
DEFAULT_TIMEOUT_S = 240.0

_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
)
_POINT_TO_POINT = ("isend", "irecv", "send", "recv")


class NCCLOrderDeadlock(RuntimeError):
    """A wait that NCCL's order would never end: the communicator's head waits for a peer that
    waits behind something else."""


@dataclass(frozen=True)
class Issued:
    """One operation as a rank issued it on a communicator (for tests)."""

    op: str  # "send", "recv" or a collective's name
    peer: int | None  # global rank of the other end (point-to-point only)
    nbytes: int
    tag: int  # the caller's tag: not used to pair


@dataclass
class _Operation:
    number: int  # its place in its communicator's issue order
    what: str
    start: Callable[[], object]  # issues the gloo operation; returns its Work (or None)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _Communicator:
    """One process group of this rank, its operations run one after another, in issue order."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float):
        self.group = group
        ranks = dist.get_process_group_ranks(group)
        desc = getattr(group, "group_desc", "") or ""
        self.name = f"'{desc}' (global ranks {ranks})" if desc and desc != "undefined" else f"global ranks {ranks}"
        self.timeout_s = timeout_s
        self.queue: collections.deque[_Operation] = collections.deque()
        self.ready = threading.Condition()
        self.issued: list[Issued] = []
        self.sequence: collections.Counter = collections.Counter()  # (op, peer) -> messages so far
        self._worker: threading.Thread | None = None

    def next_number(self, op: str, peer: int) -> int:
        """This message's number in its (communicator, sender, receiver) order: the tag gloo gets."""
        number = self.sequence[(op, peer)]
        self.sequence[(op, peer)] += 1
        return number

    def submit(self, record: Issued, what: str, start: Callable[[], object]) -> _RulesWork:
        with self.ready:  # one worker, even if two threads (a background save's) share the group
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name=f"nccl-rules {self.name}", daemon=True)
                self._worker.start()
            operation = _Operation(len(self.issued), what, start)
            self.issued.append(record)
            self.queue.append(operation)
            self.ready.notify()
        return _RulesWork(self, operation)

    def _serve(self) -> None:
        while True:
            with self.ready:
                while not self.queue:
                    self.ready.wait()
                operation = self.queue[0]  # stays at the head until it completes
            try:
                work = operation.start()
                if work is not None:
                    work.wait()
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits on it
                operation.error = error
            with self.ready:
                self.queue.popleft()
            operation.done.set()

    def deadlock(self, waiting: _Operation, waited_s: float) -> NCCLOrderDeadlock:
        with self.ready:
            queued = list(self.queue)
        rank = dist.get_rank()
        if not queued:
            return NCCLOrderDeadlock(f"rank {rank}: {waiting.what} on communicator {self.name} never completed")
        head, behind = queued[0], queued[1:]
        listed = "; ".join(f"#{op.number} {op.what}" for op in behind[:4]) + ("; ..." if len(behind) > 4 else "")
        return NCCLOrderDeadlock(
            f"rank {rank} waited {waited_s:.0f} s for #{waiting.number} {waiting.what}, which NCCL's order "
            f"would never complete: on communicator {self.name} the operation at the head is "
            f"#{head.number} {head.what}, waiting for its peer, with {len(behind)} queued behind it"
            + (f" ({listed})" if behind else "")
            + ". A list whose communicators complete in issue order must have both ends reach each "
            "operation: check the lowered lists (pipeline/schedule/lower.py, check_lowered)"
        )


class _RulesWork:
    """What a wrapped call returns: torch's Work as the pipeline uses it (wait, is_completed)."""

    def __init__(self, communicator: _Communicator, operation: _Operation):
        self._communicator = communicator
        self._operation = operation

    def wait(self, timeout=None) -> bool:
        started = time.monotonic()
        limit = self._communicator.timeout_s
        if timeout is not None:
            limit = min(limit, timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout))
        if not self._operation.done.wait(limit):
            raise self._communicator.deadlock(self._operation, time.monotonic() - started)
        if self._operation.error is not None:
            raise self._operation.error
        return True

    def is_completed(self) -> bool:
        return self._operation.done.is_set()

    def is_success(self) -> bool:
        return self.is_completed() and self._operation.error is None

    def exception(self) -> BaseException | None:
        return self._operation.error


class _Mode:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.communicators: dict[int, _Communicator] = {}
        self.lock = threading.Lock()
        self.original = {name: getattr(c10d, name) for name in (*_POINT_TO_POINT, *_COLLECTIVES)}
        self.signatures = {name: inspect.signature(self.original[name]) for name in _COLLECTIVES}

    def communicator(self, group: dist.ProcessGroup | None) -> _Communicator:
        group = group if group is not None else c10d._get_default_group()
        with self.lock:
            found = self.communicators.get(id(group))
            if found is None:
                found = self.communicators[id(group)] = _Communicator(group, self.timeout_s)
        return found

    def point_to_point(self, op: str, tensor: torch.Tensor, peer, group, tag, group_peer) -> _RulesWork | None:
        if group is not None and group is not dist.GroupMember.WORLD and dist.get_rank(group) < 0:
            return None  # not a member: torch's own calls return None too
        channel = self.communicator(group)
        if group_peer is not None:
            peer = dist.get_global_rank(channel.group, group_peer)
        if peer is None:
            raise ValueError(f"nccl_rules: {op} without a peer: NCCL has no receive from any source")
        number = channel.next_number(op, peer)
        nbytes = tensor.numel() * tensor.element_size()
        record = Issued(op, peer, nbytes, tag)
        to_from = "to" if op == "send" else "from"
        what = f"{op} of {nbytes} bytes {tuple(tensor.shape)} {to_from} global rank {peer} (message {number})"
        issue = self.original["isend" if op == "send" else "irecv"]
        peer_arg = {"dst": peer} if op == "send" else {"src": peer}
        return channel.submit(record, what, lambda: issue(tensor, group=channel.group, tag=number, **peer_arg))

    def collective(self, name: str, *args, **kwargs):
        bound = self.signatures[name].bind(*args, **kwargs)
        group = bound.arguments.get("group")
        if group is not None and group is not dist.GroupMember.WORLD and dist.get_rank(group) < 0:
            return self.original[name](*args, **kwargs)  # not a member: torch's own answer
        channel = self.communicator(group)
        async_op = bound.arguments.get("async_op", False)
        bound.arguments["async_op"] = True
        first = next(iter(bound.arguments.values()), None)
        nbytes = first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0
        work = channel.submit(
            Issued(name, None, nbytes, 0),
            f"{name} of {nbytes} bytes",
            lambda: self.original[name](*bound.args, **bound.kwargs),
        )
        if async_op:
            return work
        work.wait()
        return None

    def issued(self) -> dict[str, list[Issued]]:
        return {c.name: list(c.issued) for c in self.communicators.values() if c.issued}


_mode: _Mode | None = None


def enabled() -> bool:
    """Whether this rank's environment asks for the rules (run_on_ranks sets it: on under pytest)."""
    return os.environ.get(ENV, "1") != "0"


def install(timeout_s: float | None = None) -> None:
    """Put NCCL's rules over this process's torch.distributed calls (idempotent)."""
    global _mode
    if _mode is not None:
        return
    _mode = mode = _Mode(timeout_s if timeout_s is not None else float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        return mode.point_to_point("send", tensor, dst, group, tag, group_dst)

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        return mode.point_to_point("recv", tensor, src, group, tag, group_src)

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):
        work = isend(tensor, dst, group, tag, group_dst)
        if work is not None:
            work.wait()

    def recv(tensor, src=None, group=None, tag=0, group_src=None):
        work = irecv(tensor, src, group, tag, group_src)
        if work is not None:
            work.wait()
        return src if src is not None else dist.get_global_rank(group, group_src)

    wrapped = {"isend": isend, "irecv": irecv, "send": send, "recv": recv}
    for name in _COLLECTIVES:
        wrapped[name] = _collective(mode, name)
    for name, function in wrapped.items():
        setattr(c10d, name, function)
        setattr(dist, name, function)


def _collective(mode: _Mode, name: str):
    def call(*args, **kwargs):
        return mode.collective(name, *args, **kwargs)

    call.__name__ = name
    return call


def uninstall() -> None:
    """Give torch.distributed its own calls back."""
    global _mode
    if _mode is None:
        return
    for name, function in _mode.original.items():
        setattr(c10d, name, function)
        setattr(dist, name, function)
    _mode = None


def installed() -> bool:
    return _mode is not None


def issued() -> dict[str, list[Issued]]:
    """This rank's operations under the rules so far, per communicator (by its name), in issue order."""
    if _mode is None:
        raise RuntimeError("nccl_rules is not installed in this process")
    return _mode.issued()


def issued_on(group: dist.ProcessGroup) -> list[Issued]:
    """This rank's operations on `group` so far, in issue order."""
    if _mode is None:
        raise RuntimeError("nccl_rules is not installed in this process")
    channel = _mode.communicators.get(id(group))
    return list(channel.issued) if channel is not None else []
