"""Where a step's time goes: a profiler's kernels (or, on the CPU, its ops) by kind.

bench/gpu_step.py --profile records one step with torch.profiler and prints `breakdown(...)`: the
time of each kind (attention, matmuls, norms and elementwise, loss, optimizer, communication,
other), the device's idle time within the step, and which SDPA backend ran, named from its kernels
(flash, cuDNN, memory-efficient or the math fallback), so the attention path is read off the
profile rather than assumed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

# Kinds, tried in order: the first whose any pattern is in the kernel's lower-cased name wins.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "cudnn_sdpa", "sdpa", "attention", "efficient_attention")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax")),
    ("optimizer", ("adam", "multi_tensor_apply", "_foreach")),
    ("communication", ("nccl", "allreduce", "all_gather", "reduce_scatter", "sendrecv")),
    ("matmul", ("gemm", "matmul", "mm_", "_mm", "addmm", "cublas", "cutlass", "xmma", "sm90_", "nvjet", "linear")),
    ("norm and elementwise", ("norm", "elementwise", "triton", "silu", "mul", "add", "copy", "cat", "rotary", "fill")),
)

# SDPA's backends, by the kernel names torch's CUDA build gives each
BACKENDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cuDNN", ("cudnn",)),
    ("flash", ("flash",)),
    ("memory-efficient", ("efficient_attention", "fmha_cutlass", "mem_efficient")),
)


def kind_of(name: str) -> str:
    """The kind of a kernel or op named `name` ("other" where no pattern matches)."""
    lowered = name.lower()
    for kind, patterns in KINDS:
        if any(p in lowered for p in patterns):
            return kind
    return "other"


def sdpa_backend(names: Iterable[str]) -> str:
    """Which SDPA backend the attention kernels' names say ran ("math" where attention ran as
    matmuls and softmax: no fused attention kernel at all)."""
    lowered = [n.lower() for n in names]
    for backend, patterns in BACKENDS:
        if any(p in n for n in lowered for p in patterns):
            return backend
    return "math (no fused attention kernel)"


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: time the device ran anything."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def breakdown(kernels: Iterable[tuple[str, float, float]], step_seconds: float) -> dict[str, float]:
    """Seconds by kind of `kernels` ((name, start, end) in seconds), plus "idle": the step's time
    the device ran nothing (launch gaps, host work, waits)."""
    kernels = list(kernels)
    seconds: dict[str, float] = defaultdict(float)
    for name, start, end in kernels:
        seconds[kind_of(name)] += end - start
    seconds["idle"] = max(0.0, step_seconds - busy_seconds((s, e) for _, s, e in kernels))
    return dict(seconds)


def table(seconds: dict[str, float], step_seconds: float) -> str:
    """The breakdown as lines: kind, milliseconds, share of the step (kernels may overlap on
    several streams, so the shares need not sum to 100 %)."""
    rows = sorted(seconds.items(), key=lambda kv: -kv[1])
    return "\n".join(f"  {kind:<22} {s * 1e3:9.2f} ms  {s / step_seconds:6.1%}" for kind, s in rows)
