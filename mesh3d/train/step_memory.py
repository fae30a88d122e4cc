"""Each step's memory over every rank: what a progress line and a metrics row show, to hold the
planner's prediction against a run (torchtitan prints its max active and reserved GiB every log step).

    memory = StepMemory(layout)         # before parallelize builds the model: each rank's baseline
    ...
    memory.begin()                      # before the step: CUDA's peak counters start again
    ...                                 # the step
    peak = memory.gather()              # a collective: every rank calls it, every rank gets the same
    print(peak.describe())              # "mem +0.27 GiB (rank 1)"; with the planner's figure for that
                                        # rank: "mem +0.27 GiB (rank 1, planned 0.19 GiB)"
    row.update(peak.as_record())        # memory_rise_gib, memory_peak_gib, memory_peak_rank, and every
                                        # rank's rise and baseline (CUDA: memory_reserved_gib, _device_share)

- CUDA: the step's peak of the caching allocator (`torch.cuda.max_memory_allocated`), its
  reserved peak (`max_memory_reserved`, what the device sees taken) and that as a share of the
  device's total memory; the counters are reset by `begin()`, so the figure is this step's.
- CPU: the process's resident-set peak (`getrusage`'s `ru_maxrss`). The kernel keeps no counter
  that starts again, so this is the peak since the process began: it rises in the step that
  needs more than any before, which the first steps show.

The rise is a rank's peak less its baseline, taken when the StepMemory is made: on the CPU the
resident peak then (the interpreter, torch and the libraries, about 0.3 GiB, which the planner does
not count), on CUDA what the allocator held then. The rank whose rise is largest is the one
reported (the one that runs out first), with its peak; every rank's rise goes in the row.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mesh3d.mesh import Layout

GIB = 1024**3


@dataclass(frozen=True)
class MemoryPeak:
    """One step's memory: the rank whose rise over its baseline is largest, its figures in bytes,
    and every rank's rise, baseline and pp coordinate (which of the planner's stages it holds)."""

    peak_bytes: int  # CUDA: the allocator's allocated peak; CPU: the resident-set peak
    rank: int
    reserved_bytes: int | None = None  # CUDA only: the same rank's reserved peak
    device_total_bytes: int | None = None  # CUDA only: that device's memory
    rises: tuple[int, ...] = ()  # every rank's peak less its baseline, in rank order
    baselines: tuple[int, ...] = ()  # every rank's memory before the model was built
    pp_ranks: tuple[int, ...] = ()  # every rank's pp coordinate

    @property
    def rise_bytes(self) -> int:
        """The reported rank's rise over its baseline (its peak where no baseline was taken)."""
        return self.rises[self.rank] if self.rises else self.peak_bytes

    @property
    def device_share(self) -> float | None:
        """The reserved peak as a share of the device's memory (CUDA), else None."""
        if self.reserved_bytes is None or not self.device_total_bytes:
            return None
        return self.reserved_bytes / self.device_total_bytes

    def describe(self, planned_bytes: int | None = None) -> str:
        """The progress line's column: "mem +0.27 GiB (rank 1)", the rise over the rank's baseline,
        with reserved and the device share on CUDA, and `planned_bytes` (the planner's figure for
        that rank's stage) where given: "mem +0.27 GiB (rank 1, planned 0.19 GiB)"."""
        text = f"mem +{self.rise_bytes / GIB:.2f} GiB"
        if self.reserved_bytes is not None:
            text += f" reserved {self.reserved_bytes / GIB:.2f} GiB"
            if self.device_share is not None:
                text += f" {self.device_share:.1%}"
        planned = "" if planned_bytes is None else f", planned {planned_bytes / GIB:.2f} GiB"
        return text + f" (rank {self.rank}{planned})"

    def as_record(self) -> dict[str, float | int | list[float]]:
        """The metrics row's columns (GiB; the share a fraction of 1; the lists in rank order)."""
        record: dict[str, float | int | list[float]] = {
            "memory_rise_gib": self.rise_bytes / GIB,
            "memory_peak_gib": self.peak_bytes / GIB,
            "memory_peak_rank": self.rank,
        }
        if self.rises:
            record["memory_rise_gib_by_rank"] = [rise / GIB for rise in self.rises]
            record["memory_baseline_gib_by_rank"] = [baseline / GIB for baseline in self.baselines]
        if self.reserved_bytes is not None:
            record["memory_reserved_gib"] = self.reserved_bytes / GIB
            record["memory_device_share"] = self.device_share
        return record


class StepMemory:
    """Measures each rank's step peak and gathers them (see the module docstring); made before the
    model is built, it takes this rank's baseline then."""

    def __init__(self, layout: Layout):
        self.device = layout.device
        self.on_cuda = self.device.type == "cuda"
        self.pp_rank = layout.pp_rank
        self.baseline = torch.cuda.memory_allocated(self.device) if self.on_cuda else resident_peak_bytes()

    def begin(self) -> None:
        """Start the step's peak (CUDA's counters; nothing to reset on the CPU)."""
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def local(self) -> tuple[int, int]:
        """This rank's (peak bytes, reserved peak bytes; 0 on the CPU)."""
        if self.on_cuda:
            return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)
        return resident_peak_bytes(), 0

    def gather(self) -> MemoryPeak:
        """Every rank's figures, the same on each, the largest rise reported; a collective (one
        all-gather) when the process group has more than one rank."""
        # float64 holds bytes exactly up to 8 PiB
        mine = torch.tensor((*self.local(), self.baseline, self.pp_rank), dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine)
            everyone = torch.stack(rows).cpu()
        else:
            everyone = mine.unsqueeze(0).cpu()
        peaks, reserved, baselines, pp_ranks = ([int(v) for v in column] for column in everyone.T.tolist())
        # a CPU baseline is a peak too (ru_maxrss): a peak that has not risen since reads 0, never less
        rises = tuple(max(0, peak - baseline) for peak, baseline in zip(peaks, baselines, strict=True))
        rank = max(range(len(rises)), key=rises.__getitem__)
        per_rank = dict(rises=rises, baselines=tuple(baselines), pp_ranks=tuple(pp_ranks))
        if not self.on_cuda:
            return MemoryPeak(peaks[rank], rank, **per_rank)
        total = torch.cuda.get_device_properties(self.device).total_memory
        return MemoryPeak(peaks[rank], rank, reserved[rank], total, **per_rank)


def resident_peak_bytes() -> int:
    """This process's resident-set peak since it began, in bytes."""
    # ru_maxrss is in KiB on Linux, bytes on macOS
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024
