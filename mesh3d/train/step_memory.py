"""Each step's memory peak over every rank, and which rank holds it: what a progress line and a
metrics row show, to hold the planner's prediction against a run (torchtitan prints its max
active and reserved GiB every log step).

    memory = StepMemory(layout)
    memory.begin()                      # before the step: CUDA's peak counters start again
    ...                                 # the step
    peak = memory.gather()              # a collective: every rank calls it, every rank gets the same
    print(peak.describe())              # "mem 1.23 GiB (rank 5)"; CUDA: "mem 1.23 GiB reserved 1.40 GiB 1.8% (rank 5)"
    row.update(peak.as_record())        # memory_peak_gib, memory_peak_rank (CUDA: memory_reserved_gib, _device_share)

- CUDA: the step's peak of the caching allocator (`torch.cuda.max_memory_allocated`), its
  reserved peak (`max_memory_reserved`, what the device sees taken) and that as a share of the
  device's total memory; the counters are reset by `begin()`, so the figure is this step's.
- CPU: the process's resident-set peak (`getrusage`'s `ru_maxrss`). The kernel keeps no counter
  that starts again, so this is the peak since the process began: it rises in the step that
  needs more than any before, which the first steps show.

The largest of the ranks' figures is reported with its rank: the one that runs out first.
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
    """One step's memory peak: the largest over the ranks, in bytes, and the rank it was on."""

    peak_bytes: int  # CUDA: the allocator's allocated peak; CPU: the resident-set peak
    rank: int
    reserved_bytes: int | None = None  # CUDA only: the same rank's reserved peak
    device_total_bytes: int | None = None  # CUDA only: that device's memory

    @property
    def device_share(self) -> float | None:
        """The reserved peak as a share of the device's memory (CUDA), else None."""
        if self.reserved_bytes is None or not self.device_total_bytes:
            return None
        return self.reserved_bytes / self.device_total_bytes

    def describe(self) -> str:
        """The progress line's column: "mem 1.23 GiB (rank 3)", with reserved and the device share on CUDA."""
        text = f"mem {self.peak_bytes / GIB:.2f} GiB"
        if self.reserved_bytes is not None:
            text += f" reserved {self.reserved_bytes / GIB:.2f} GiB"
            if self.device_share is not None:
                text += f" {self.device_share:.1%}"
        return text + f" (rank {self.rank})"

    def as_record(self) -> dict[str, float | int]:
        """The metrics row's columns (GiB; the share a fraction of 1)."""
        record: dict[str, float | int] = {"memory_peak_gib": self.peak_bytes / GIB, "memory_peak_rank": self.rank}
        if self.reserved_bytes is not None:
            record["memory_reserved_gib"] = self.reserved_bytes / GIB
            record["memory_device_share"] = self.device_share
        return record


class StepMemory:
    """Measures each rank's step peak and gathers the largest (see the module docstring)."""

    def __init__(self, layout: Layout):
        self.device = layout.device
        self.on_cuda = self.device.type == "cuda"

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
        """The largest peak over every rank, the same on each; a collective (one all-gather) when
        the process group has more than one rank."""
        mine = torch.tensor(self.local(), dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine)
            everyone = torch.stack(rows).cpu()
        else:
            everyone = mine.unsqueeze(0).cpu()
        rank = int(everyone[:, 0].argmax())
        peak, reserved = (int(v) for v in everyone[rank].tolist())
        if not self.on_cuda:
            return MemoryPeak(peak, rank)
        return MemoryPeak(peak, rank, reserved, torch.cuda.get_device_properties(self.device).total_memory)


def resident_peak_bytes() -> int:
    """This process's resident-set peak since it began, in bytes."""
    # ru_maxrss is in KiB on Linux, bytes on macOS
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024
