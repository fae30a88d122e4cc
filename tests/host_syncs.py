"""Count the reads that stop the host until the device catches up (device-to-host synchronizations).

    with HostSyncCounter() as syncs:
        loss = pm.step(inputs, targets)  # unread
    assert syncs.count == 0, syncs.ops

On CUDA a value read into Python (`.item()`, `bool(t)`, `int(t)`, `.tolist()`) or a copy to the
host (`.cpu()`, `.to("cpu")`, `.numpy()` after one) waits for every kernel queued before it. On
CPU nothing waits, but the same calls still run, so counting them on CPU counts what would wait on
CUDA. Two layers see them:

- a TorchDispatchMode sees the aten ops every such read funnels into: `_local_scalar_dense`
  (item, bool, int, float, is_nonzero) and a copy whose source is off the host and whose
  destination is on it (`_to_copy`, `copy_`);
- a TorchFunctionMode sees `Tensor.tolist`, which on a CPU tensor reads memory directly and
  reaches no aten op (on CUDA it is a device-to-host copy, counted once here, not again below).

Reads through numpy are not counted, and need not be: `.numpy()` refuses a CUDA tensor, so code
that reads a tensor through numpy reads host memory on every device (the batch before its
transfer, a flag exchanged over the host group, a pinned buffer a non-blocking copy filled), and
a tensor that would live on the compute device read so fails on a GPU (tests/gpu runs the step
there). Reads through torch (`.item()`, `bool()`, `.tolist()`) are counted whatever the tensor's
device: on CPU a host tensor read that way counts as a device read would, so host-side checks
read their tensors through numpy. A non-blocking copy into pinned memory (`copy_` with
`non_blocking=True`) is not counted: it is queued on the stream like a kernel, and whoever reads
its destination waits for its event, not for the device (step/late_verdicts.py).

What is not counted either: a torch optimizer's step (its step counters live on the host unless it is
capturable or fused, so their reads wait for no device), host data read on the host (numpy
arrays, a batch still on the CPU before its transfer: code that reads it through numpy runs no
aten op), and collectives, which queue on the device without stopping the host.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READS = {torch.ops.aten._local_scalar_dense.default}
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


def _device_of(value) -> torch.device | None:
    return value.device if isinstance(value, torch.Tensor) else None


def _is_copy_to_host(func, args, kwargs) -> bool:
    if func not in _COPIES:
        return False
    if func is torch.ops.aten.copy_.default:
        if (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) and args[0].is_pinned():
            return False  # queued on the stream into page-locked memory: the host does not wait
        destination, source = _device_of(args[0]), _device_of(args[1])
    else:
        source = _device_of(args[0])
        destination = torch.device(kwargs["device"]) if kwargs.get("device") is not None else source
    return source is not None and source.type != "cpu" and destination is not None and destination.type == "cpu"


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counter.inside_tolist and (func in _SCALAR_READS or _is_copy_to_host(func, args, kwargs)):
            self.counter.record(str(func))
        return func(*args, **kwargs)


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.Tensor.tolist:
            return func(*args, **kwargs)
        self.counter.record("Tensor.tolist")
        self.counter.inside_tolist = True  # its own device-to-host copy is this one read
        try:
            return func(*args, **kwargs)
        finally:
            self.counter.inside_tolist = False


class HostSyncCounter:
    """A context manager counting device-to-host synchronizations (see the module docstring):
    `count` of them, `ops` naming each in order."""

    def __init__(self) -> None:
        self.ops: list[str] = []
        self.inside_tolist = False
        self.inside_optimizer = False
        self._hooks = []
        self._modes = (_FunctionCounter(self), _DispatchCounter(self))

    @property
    def count(self) -> int:
        return len(self.ops)

    def record(self, what: str) -> None:
        if not self.inside_optimizer:
            self.ops.append(what)

    def _optimizer_step(self, inside: bool):
        def hook(*_):
            self.inside_optimizer = inside

        return hook

    def __enter__(self) -> HostSyncCounter:
        self._hooks = [
            register_optimizer_step_pre_hook(self._optimizer_step(True)),
            register_optimizer_step_post_hook(self._optimizer_step(False)),
        ]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
