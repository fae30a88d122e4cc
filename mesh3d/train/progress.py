"""The progress line: step, loss, lr, grad norm, elapsed time, ETA, tokens/s and MFU, in human units.

    progress = Progress(total_steps=1000, tokens_per_step=16 * 128, start_step=0,
                        flops_per_token=per_token, peak_flops=peak, world_size=8, device="cpu")
    print(progress.line(step, loss, lr, grad_norm, step_seconds))
    # (one line, wrapped here)
    # step    10  loss 3.2101  lr 1.50e-03  grad_norm 0.812  elapsed 12.4s  eta 1m05s  tokens/s 1.7k
    #   MFU n/a (peak FLOP/s unknown for cpu)

Counts read 950, 12.3k, 4.1M, 2.0B; durations 4.2s, 42s, 1m05s, 2h03m, 1d04h. The ETA is the
mean time of the steps this process ran so far, times the steps left: a resumed run's ETA counts
its own steps only.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from mesh3d.train.flops import mfu

_UNITS = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"))


def human_count(n: float) -> str:
    """950 -> "950", 12_345 -> "12.3k", 4_100_000 -> "4.1M": never "0.0M"."""
    if not math.isfinite(n):
        return str(n)
    sign, n = ("-" if n < 0 else ""), abs(n)
    for scale, unit in _UNITS:
        # Round first, so 999_960 reads "1.0M", not "1000.0k".
        if round(n / scale, 1) >= 1.0 and (unit == "T" or round(n / scale, 1) < 1000):
            return f"{sign}{n / scale:.1f}{unit}"
    return f"{sign}{n:.0f}"


def human_duration(seconds: float) -> str:
    """4.23 -> "4.2s", 65 -> "1m05s", 7380 -> "2h03m", 100800 -> "1d04h"."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 10:
        return f"{max(seconds, 0.0):.1f}s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


@dataclass
class Progress:
    """Times the run and writes its progress lines; one per process (rank 0 prints them).

    Args:
        total_steps: the step the run ends at (steps count from 1).
        tokens_per_step: tokens of one global batch (all ranks together).
        start_step: the step the run starts after (a resumed run's checkpoint step).
        flops_per_token: the model's FLOPs per token, forward and backward (flops.flops_per_token),
            or None to leave MFU out.
        peak_flops: one device's peak FLOP/s (flops.peak_flops), None when unknown.
        world_size: the devices the run uses.
        device: the device's name, for the line that says its peak is unknown.
        started: when the run started (time.perf_counter()); default: now.
    """

    total_steps: int
    tokens_per_step: int
    start_step: int = 0
    flops_per_token: float | None = None
    peak_flops: float | None = None
    world_size: int = 1
    device: str = "cpu"
    started: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        """Seconds since this Progress was made (the start of this process's training)."""
        return time.perf_counter() - self.started

    def eta(self, step: int) -> float:
        """Seconds left after `step`, at the mean pace of the steps this process ran."""
        done = step - self.start_step
        if done <= 0:
            return math.inf
        return self.elapsed() / done * max(0, self.total_steps - step)

    def utilization(self, tokens_per_s: float) -> float | None:
        """MFU at this throughput, or None (no FLOP count, or the device's peak is unknown)."""
        if self.flops_per_token is None:
            return None
        return mfu(self.flops_per_token, tokens_per_s, self.peak_flops, self.world_size)

    def line(self, step: int, loss: float, lr: float, grad_norm: float | None, step_seconds: float) -> str:
        """The progress line after `step` (counted from 1), which took `step_seconds`; without a
        grad_norm column when `grad_norm` is None (a never-drain schedule has no whole gradient)."""
        tokens_per_s = self.tokens_per_step / step_seconds if step_seconds > 0 else math.inf
        norm = "" if grad_norm is None else f"grad_norm {grad_norm:.3f}  "
        text = (
            f"step {step:5d}  loss {loss:.4f}  lr {lr:.2e}  {norm}"
            f"elapsed {human_duration(self.elapsed())}  eta {human_duration(self.eta(step))}  "
            f"tokens/s {human_count(tokens_per_s)}"
        )
        if self.flops_per_token is not None:
            utilization = self.utilization(tokens_per_s)
            text += (
                f"  MFU {utilization:.1%}"
                if utilization is not None
                else f"  MFU n/a (peak FLOP/s unknown for {self.device})"
            )
        return text
