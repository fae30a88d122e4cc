"""Verdicts that only the device knows, judged one call late, so that no step waits for them.

Two checks of a step are device values: a (loss_sum, count) loss's counts during the step against
those found before it (the recount: a count that depends on the output scaled the gradients
wrongly), and context-parallel attention's call verdicts (call_verdicts.py). They travel in the
loss's world all-reduce, so every rank holds the same sums; but reading them at the step's end
would stop the host until the device has run the whole step (on CUDA, every kernel queued before
the read), which is the drain a step must not have (issue 65).

So a call leaves its verdict in host memory, copied without waiting (on CUDA a non-blocking copy
into page-locked memory, queued after the all-reduce, with an event after it), and the next call
(`pm.step` or `pm.evaluate`) judges it at its own end, once its own work is queued: the host waits
then, if at all, for the previous call's all-reduce, never for what it has just queued, and the
device stays a call ahead. Every rank judges the same sums at the same point of the same call and
raises alike, so none is left waiting in a collective.

What lateness costs: the error is raised by the call after the faulty one, before that call's own
update (`optimizer=` at parallelize); the faulty call's update has happened (with `optimizer=`, or
the caller's optimizer.step after it), and `.grad` holds the raising call's gradients
(`zero_grad()` before going on). A never-drain schedule marks the raising call failed, as for any
error in a call. A faulty last call of a run is judged by `pm.flush()` (which `evaluate`, the
checkpoint functions and `full_state_dict` call, and a training loop calls at its end): it reads
the held verdict at once, on every rank (`judge_now`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Judge = Callable[[list[float]], None]  # raises, on every rank alike, where the summed flags say so


@dataclass
class _Held:
    """One call's flags in host memory, and what reads them."""

    host: torch.Tensor
    ready: torch.cuda.Event | None  # recorded after the copy (CUDA), None where the copy was done at once
    judge: Judge

    @classmethod
    def of(cls, flags: torch.Tensor, judge: Judge) -> _Held:
        on_cuda = flags.device.type == "cuda"
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=on_cuda)  # page-locked: the copy is queued
        host.copy_(flags.detach(), non_blocking=on_cuda)
        ready = None
        if on_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return cls(host, ready, judge)

    def read(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()  # the copy's own event: what was queued after it is not waited for
        self.judge(self.host.numpy().tolist())  # host memory, read through numpy


class LateVerdicts:
    """The last call's device verdict, held in host memory until the next call judges it (see the
    module docstring)."""

    def __init__(self) -> None:
        self._held: _Held | None = None

    def hold_and_judge_previous(self, flags: torch.Tensor, judge: Judge) -> None:
        """Hold this call's `flags` (summed over the world, on the device), then judge the previous
        call's: raises where it was faulty, this call's kept for the next."""
        previous, self._held = self._held, (_Held.of(flags, judge) if flags.numel() else None)
        if previous is not None:
            previous.read()

    def discard(self) -> None:
        """Forget the held verdict unjudged: the weights it was about are being replaced (a load)."""
        self._held = None

    def judge_now(self) -> None:
        """Judge the held verdict at once (the host waits for the call that made it), on every rank."""
        held, self._held = self._held, None
        if held is not None:
            held.read()
