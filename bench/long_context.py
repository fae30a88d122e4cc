"""Per-rank step memory and tokens/s against sequence length under context parallelism (cp).

    python bench/long_context.py --seq 8192 16384 --cp 1 2 4
    python bench/long_context.py --seq 8192 --cp 1 4 --device cuda     # one GPU per rank

The example LLaMA at dim 256, 4 layers, 8 heads, vocabulary 256 (FFN 768, fp32), one sequence
(batch 1) per step, at (pp, dp, tp) = (1, 1, 1) and cp = 1, 2, 4 ranks (gloo; FSDP over the cp
ranks, the default schedule 1F1B with one microbatch, the default (sum, count) cross-entropy).
Every rank of the cp group is handed the same whole row; mesh3d cuts it into 2 x cp chunks.

Each (seq, cp) runs in processes of its own (tests/multiprocess.run_on_ranks: ranks forked from a
fork server that has imported torch), so no peak of another configuration counts. On each rank:
build_mesh, parallelize, then the first `pm.step` is the measured one (no warm-up step: it would
raise the peak itself, so the rise includes the first step's one-time allocations: gradients,
FSDP's lazy setup, gloo's buffers).

- CPU: the rise of `resource.getrusage(RUSAGE_SELF).ru_maxrss` (peak resident memory) during the
  step: ru_maxrss after the step minus ru_maxrss just before it. Just before it the high-water
  mark is restarted at the current resident size (writing 5 to /proc/self/clear_refs, Linux >=
  4.0), so a peak of the setup above the resident size does not hide the step's; where that
  fails (ru_maxrss stays above the resident size) the rise is a lower bound, and the table says so.
  Resident memory is what glibc's malloc holds, not only live tensors: a tensor of under 32 MiB
  freed in the middle of the heap stays resident. `--mmap-threshold 131072` sets glibc's
  M_MMAP_THRESHOLD in each rank before it builds anything (`mallopt`, as MALLOC_MMAP_THRESHOLD_
  would): every allocation of 128 KiB or more is then a mapping of its own, returned when freed,
  and the rise follows the bytes of live tensors.
- CUDA (`--device cuda`): `torch.cuda.max_memory_allocated()` during the step (peak stats reset
  just before) minus `memory_allocated()` before it: the caching allocator's live tensors, not
  what it reserves.

Then `--steps` more steps (gradients zeroed between) give the median step time; tokens/s is the
sequence's tokens over it (the cp group's throughput: its ranks work on one sequence together).
With more ranks than cores (cp = 4 on a 2-core machine) the times measure contention, not cp's
speed; the memory figures do not depend on it.

Prints one row per (seq, cp): the per-rank rise (max over the cp ranks, MiB), its ratio to cp = 1
at the same seq (when cp = 1 was run), the step time and tokens/s.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from multiprocess import run_on_ranks  # noqa: E402

import mesh3d  # noqa: E402
from examples.llama.config import ModelArgs  # noqa: E402
from examples.llama.model import Transformer  # noqa: E402

MIB = 2**20


def model_args(seq: int) -> ModelArgs:
    """The benchmark's model: the example LLaMA at dim 256, 4 layers, 8 heads, vocabulary 256."""
    return ModelArgs(dim=256, n_layers=4, n_heads=8, vocab_size=256, max_seq_len=seq)


class Measured(NamedTuple):
    """One rank's figures for one (seq, cp) (bytes; seconds)."""

    rise: int  # peak during the first step over the memory just before it
    exact: bool  # False: the high-water mark could not be restarted (CPU): the rise is a lower bound
    first_step_seconds: float
    step_seconds: float  # median of the later steps (the first step's time if none)
    loss: float  # the first step's
    grad_norm: float  # after the first step


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _restart_peak() -> bool:
    """Restart this process's resident high-water mark (VmHWM, ru_maxrss) at its current size."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def set_mmap_threshold(size: int) -> None:
    """glibc's M_MMAP_THRESHOLD for this process (fixed: glibc no longer raises it as blocks are freed)."""
    if ctypes.CDLL(None).mallopt(-3, size) != 1:  # M_MMAP_THRESHOLD = -3 (malloc.h)
        raise RuntimeError(f"mallopt(M_MMAP_THRESHOLD, {size}) failed: not glibc?")


def measure(
    seq: int, cp: int, steps: int = 0, device: str = "cpu", mmap_threshold: int | None = None, schedule: str = "1f1b"
) -> Measured:
    """On each rank of a cp group: one sequence of `seq` tokens, the first step's memory rise, then
    `steps` more steps timed."""
    if mmap_threshold is not None:
        set_mmap_threshold(mmap_threshold)
    torch.set_num_threads(1)
    layout = mesh3d.build_mesh(pp=1, dp=1, cp=cp, tp=1, device=device)
    with torch.device("meta"):
        model = Transformer(model_args(seq))
    pm = mesh3d.parallelize(model, layout, schedule=schedule, microbatches=1, seed=0)
    # The same whole row on every rank of the cp group; contiguous, as a copy to the device makes them.
    row = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = (t.contiguous().to(layout.device) for t in (row[:, :-1], row[:, 1:]))
    cuda = layout.device.type == "cuda"
    gc.collect()
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before, exact = torch.cuda.memory_allocated(), True
    else:
        _restart_peak()
        before = _max_rss_bytes()
        exact = before - _resident_bytes() < MIB  # the high-water mark stands at the resident size
    start = time.perf_counter()
    loss = pm.step(inputs, targets).item()  # .item(): the step has finished on this rank
    first = time.perf_counter() - start
    rise = (torch.cuda.max_memory_allocated() if cuda else _max_rss_bytes()) - before
    grad_norm = pm.clip_grad_norm_(float("inf")).item()  # the norm over every rank's gradients; none clipped
    times = []
    for _ in range(steps):
        pm.zero_grad()
        dist.barrier()
        start = time.perf_counter()
        pm.step(inputs, targets).item()
        times.append(time.perf_counter() - start)
    return Measured(rise, exact, first, statistics.median(times) if times else first, loss, grad_norm)


def run(
    seq: int, cp: int, steps: int = 0, device: str = "cpu", mmap_threshold: int | None = None, timeout: float = 1800
) -> list[Measured]:
    """`measure` on cp fresh ranks; each rank's figures."""
    return run_on_ranks(measure, cp, seq, cp, steps, device, mmap_threshold, timeout=timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[8192])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the measured first one")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--mmap-threshold", type=int, default=None, help="glibc's M_MMAP_THRESHOLD in the ranks, bytes")
    args = parser.parse_args()
    for seq in args.seq:
        for cp in args.cp:
            if seq % (2 * cp):
                parser.error(f"--seq {seq} does not cut into 2*cp={2 * cp} equal chunks")
    what = "torch.cuda.max_memory_allocated"
    if args.device == "cpu":
        threshold = "glibc's default" if args.mmap_threshold is None else args.mmap_threshold
        what = f"ru_maxrss (M_MMAP_THRESHOLD {threshold})"
    print(
        f"example LLaMA dim 256, 4 layers, 8 heads, vocab 256, fp32; batch 1; pp=dp=tp=1, 1f1b, 1 microbatch; "
        f"{args.device}, torch {torch.__version__}, {os.cpu_count()} CPU cores; rise: {what} during the first step "
        "over the memory before it, max over the cp ranks; step: median of "
        f"{args.steps} later steps"
    )
    print("  seq  cp  rise MiB  per rank (MiB)           vs cp=1  step s  tokens/s")
    for seq in args.seq:
        alone = None
        for cp in args.cp:
            ranks = run(seq, cp, args.steps, args.device, args.mmap_threshold)
            rise = max(r.rise for r in ranks)
            if cp == 1:
                alone = rise
            ratio = f"{rise / alone:6.3f}" if alone else "     -"
            step = max(r.step_seconds for r in ranks)
            each = " ".join(f"{r.rise / MIB:.0f}" for r in ranks)
            bound = "" if all(r.exact for r in ranks) else "  (lower bound: peak not restarted)"
            print(
                f"{seq:5d}  {cp:2d}  {rise / MIB:8.0f}  {each:23}  {ratio}  {step:6.2f}  {seq / step:8,.0f}{bound}",
                flush=True,
            )


if __name__ == "__main__":
    main()
