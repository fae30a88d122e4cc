"""`--profile DIR`: torch profiler traces of a few steps, one Chrome trace per rank.

    --profile runs/profile                 # steps 2-3: past the first step's one-time work
    --profile runs/profile --profile-steps 5:8

Each rank writes DIR/rank<R>.json (open it in Perfetto, https://ui.perfetto.dev, or chrome://tracing):
the ops of those steps on the host and, on CUDA, the kernels, with their input shapes; each step a
`ProfilerStep#N` span (N the training step, prof.step() between steps), and inside it each pipeline
action a span named by its kind, stage and microbatch (`F stage 0 mb 1`, `send F stage 0 mb 1 ->
pp 1`: mesh3d/pipeline/action_spans.py), so the schedule reads as mesh3d's simulator draws it; the
sends, receives and collectives show as gloo/NCCL ops within. On CUDA it also writes
DIR/rank<R>_memory.pickle, a snapshot of the allocator over the window (drop it on
https://pytorch.org/memory_viz). Nothing of the profiler runs outside the window.

Kineto (the profiler's engine) logs a `USDT: ... profiler_start` and `profiler_stop` line to stderr
at each start and stop, on every rank: markers for system tracers, no problem of the run. They
are silenced (KINETO_LOG_LEVEL=6, unless the environment sets it: KINETO_LOG_LEVEL=0 shows all of
kineto's log, its warnings included).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class StepWindow:
    """The steps from `first` to `last` (inclusive, counted from 1). Written as "A:B", the form
    --profile-steps takes, so the effective config's TOML reads back as the same flag."""

    first: int
    last: int

    def __str__(self) -> str:
        return f"{self.first}:{self.last}"


DEFAULT_STEPS = StepWindow(2, 3)
# Kineto's log levels run from 0 (verbose) to 5 (USDT, its start and stop markers): 6 says none.
KINETO_QUIET = "6"


def profile_window(text: str) -> StepWindow:
    """--profile-steps "A:B" (the steps from A to B, counted from 1), or "A" (that step alone)."""
    first, _, last = text.partition(":")
    try:
        window = StepWindow(int(first), int(last or first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--profile-steps takes A:B (steps, from 1), got {text!r}") from None
    if window.first < 1 or window.last < window.first:
        raise argparse.ArgumentTypeError(f"--profile-steps takes 1 <= A <= B, got {text!r}")
    return window


class StepProfiler:
    """Profiles the steps of `window` (inclusive, counted from 1) on this rank: call `before(step)`
    and `after(step)` around each step; the trace is written after the window's last step, and
    rank 0 says where. With `directory` None it does nothing."""

    def __init__(self, directory: str | None, window: StepWindow, rank: int, device: torch.device):
        self.directory = Path(directory) if directory else None
        self.window = window
        self.rank = rank
        self.on_cuda = device.type == "cuda"
        self._profiler: torch.profiler.profile | None = None

    @property
    def trace_path(self) -> Path:
        return self.directory / f"rank{self.rank}.json"

    def before(self, step: int) -> None:
        if self.directory is None or step != self.window.first:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.on_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)  # read when kineto first starts
        # A schedule that always records: with one, the profiler opens a ProfilerStep#N span per step.
        self._profiler = torch.profiler.profile(
            activities=activities, record_shapes=True, schedule=lambda _: torch.profiler.ProfilerAction.RECORD
        )
        self._profiler.step_num = step  # so ProfilerStep#N names the training step
        self._profiler.__enter__()

    def after(self, step: int) -> str | None:
        """At the window's last step: stop, write the trace; its path (None at any other step)."""
        if self._profiler is None:
            return None
        if step != self.window.last:
            self._profiler.step()  # ProfilerStep#step ends, #step+1 begins
            return None
        self._profiler.__exit__(None, None, None)
        self._profiler.export_chrome_trace(str(self.trace_path))
        self._profiler = None
        if self.on_cuda:
            torch.cuda.memory._dump_snapshot(str(self.directory / f"rank{self.rank}_memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.rank == 0:
            print(f"profiled steps {self.window.first}-{step}: {self.directory}/rank<R>.json, one per rank", flush=True)
        return str(self.trace_path)
