"""Each pipeline action a span of its own in a profiler trace, named by what it is.

Under `torch.profiler`, every action a rank runs (runtime.py hands each to stage_compute.py)
becomes a `record_function` span named by its kind, stage and microbatch: `F stage 0 mb 1`,
`I stage 3 mb 0`, `send F stage 0 mb 1 -> pp 1`, `recv B stage 2 mb 0 <- pp 2`. The profiler's
`ProfilerStep#N` spans around them (the training loop's `prof.step()`) give the step, so the
schedule reads in Perfetto as mesh3d's simulator draws it (schedule/draw.py). A receive's span is
its posting; the wait for the message shows inside the F, B or I that takes it.

A span costs a few microseconds even with no profiler to record it, so none is opened unless one
is recording (`torch.autograd.profiler._is_profiler_enabled`: a flag read per action).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch.autograd import profiler

from mesh3d.pipeline.schedule.ir import Action, Kind

_MESSAGES = {
    Kind.SEND_F: ("send F", "->"),
    Kind.SEND_B: ("send B", "->"),
    Kind.RECV_F: ("recv F", "<-"),
    Kind.RECV_B: ("recv B", "<-"),
}


def span_name(action: Action) -> str:
    """The span's name: the action's kind (F, B, I, W, U, TIE, send/recv F/B), stage, microbatch and,
    for a message, the peer pp rank."""
    if action.kind in _MESSAGES:
        what, arrow = _MESSAGES[action.kind]
        peer = f" {arrow} pp {action.peer}" if action.peer is not None else ""
        return f"{what} stage {action.stage} mb {action.microbatch}{peer}"
    return f"{action.kind.value} stage {action.stage} mb {action.microbatch}"


def action_span(action: Action) -> AbstractContextManager:
    """A `record_function` span for `action` while a profiler records; otherwise nothing."""
    if not profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return torch.profiler.record_function(span_name(action))
