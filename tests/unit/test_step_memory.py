"""mesh3d.train.step_memory: a step's memory peak, what the progress line and a metrics row say of it.

On the CPU (no process group: one rank) the peak is the process's resident-set peak, which a
step that allocates more than any before raises; the CUDA figures' columns and wording are
checked on a MemoryPeak built with them (the gathering over ranks: test_train_checkpoint.py)."""

import resource
import types

import pytest
import torch

from mesh3d.train import MemoryPeak, StepMemory
from mesh3d.train.step_memory import GIB


def _cpu_layout():
    return types.SimpleNamespace(device=torch.device("cpu"))


def test_the_cpu_peak_is_the_resident_peak_and_rises_with_a_bigger_step():
    memory = StepMemory(_cpu_layout())
    memory.begin()
    before = memory.gather()
    assert before.rank == 0 and before.reserved_bytes is None and before.device_share is None
    assert 0 < before.peak_bytes <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grown = torch.ones(before.peak_bytes // 4 + 64 * 1024**2 // 4)  # more than the whole peak so far
    memory.begin()
    after = memory.gather()
    assert after.peak_bytes >= before.peak_bytes + grown.numel() * 4 // 2
    record = after.as_record()
    assert set(record) == {"memory_peak_gib", "memory_peak_rank"}
    assert record["memory_peak_gib"] == pytest.approx(after.peak_bytes / GIB) and record["memory_peak_rank"] == 0


def test_what_the_line_and_the_row_say():
    cpu = MemoryPeak(peak_bytes=int(1.5 * GIB), rank=3)
    assert cpu.describe() == "mem 1.50 GiB (rank 3)"
    cuda = MemoryPeak(peak_bytes=12 * GIB, rank=5, reserved_bytes=14 * GIB, device_total_bytes=80 * GIB)
    assert cuda.describe() == "mem 12.00 GiB reserved 14.00 GiB 17.5% (rank 5)"
    assert cuda.as_record() == {
        "memory_peak_gib": 12.0,
        "memory_peak_rank": 5,
        "memory_reserved_gib": 14.0,
        "memory_device_share": 0.175,
    }
