"""The machines the planner plans for: a GPU's peak rate, memory and links, as datasheets state them.

A `Hardware` is one accelerator and the links it has to its peers: within a node (NVLink) and
between nodes (the node's network, per GPU). The presets quote NVIDIA's datasheets (SXM parts);
what a real run reaches of these peaks is the planner's business (constants.py), not the
hardware's. `hardware="this-machine"` measures the machine the planner runs on instead
(measure/machine_bench.py; search_space.resolve_hardware picks one or the other).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from mesh3d.planner import constants as C
from mesh3d.planner.held_out import HeldOutBand

GIB = 2**30
GB = 10**9


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class CollectiveTimes:
    """Seconds each collective took between two ranks of a machine, measured at several sizes
    (measure/machine_bench.py).

    A size is the bytes each rank sends by the ring algorithm (an all-gather of a local shard s over
    n ranks sends (n-1)s, a reduce-scatter of S sends (n-1)S/n, an all-reduce twice that). Over n
    ranks a ring takes n-1 times the steps it takes over two, each moving 1/(n-1) of what a rank
    sends: n-1 measured collectives of that size. Between measured sizes the time is interpolated
    linearly; below the smallest it is the smallest's (a fixed cost); above the largest it grows at
    the largest's rate (its seconds per byte). Times are made non-decreasing in size (a noisy
    measurement of a larger size cannot make it cheaper)."""

    # collective -> ((sent bytes, seconds), ...), by size; not hashed (a dict), compared
    points: dict[str, tuple[tuple[float, float], ...]] = field(hash=False)

    def __post_init__(self):
        monotone = {}
        for kind in COLLECTIVES:
            points = self.points.get(kind, ())
            if len(points) < 2 or any(b <= a for (a, _), (b, _) in zip(points, points[1:])):
                raise ValueError(
                    f"CollectiveTimes: {kind!r} needs at least two sizes in increasing order, got {points!r}"
                )
            slowest, kept = 0.0, []
            for size, seconds in points:
                slowest = max(slowest, seconds)
                kept.append((size, slowest))
            monotone[kind] = tuple(kept)
        object.__setattr__(self, "points", monotone)

    def seconds(self, kind: str, sent_bytes: float, ranks: int = 2) -> float:
        """Seconds of one `kind` collective over `ranks` ranks in which each rank sends `sent_bytes`."""
        steps = max(1, ranks - 1)
        return steps * self._two_ranks(kind, sent_bytes / steps)

    def _two_ranks(self, kind: str, sent_bytes: float) -> float:
        points = self.points[kind]
        largest, slowest = points[-1]
        if sent_bytes >= largest:
            return slowest * sent_bytes / largest
        at = max(bisect.bisect_left([size for size, _ in points], sent_bytes), 1)
        (x0, y0), (x1, y1) = points[at - 1], points[at]
        if sent_bytes <= x0:
            return y0
        return y0 + (y1 - y0) * (sent_bytes - x0) / (x1 - x0)


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. Rates in FLOP/s and bytes/s, one direction, per device."""

    name: str
    peak_flops: float  # dense bf16 (tensor cores)
    memory_bytes: int
    intra_node_bandwidth: float  # to a peer in the node (NVLink), per device
    inter_node_bandwidth: float  # to a peer in another node (the node's network, per device)
    memory_bandwidth: float  # HBM, for the optimizer's elementwise update
    peak_fp32_flops: float | None = None  # for param_dtype=None (fp32 compute); None: peak_flops / 2
    source: str = ""
    # What a step's FLOPs reach of the peak; None: constants.ACHIEVABLE_COMPUTE_FRACTION (a
    # datasheet peak). A preset's is fitted on published runs (`fitted_on`); a measured machine
    # ("this-machine") states 1: its peak is a rate reached.
    achievable_fraction: float | None = None
    fitted_on: str = ""  # the published runs `achievable_fraction` was fitted on (docs/plan.md)
    # How far the planner's tokens/s may stand from a real run on this hardware, as a fraction:
    # a preset's covers its held-out errors (`held_out`), not the in-sample ones its fit saw; None:
    # constants.UNCALIBRATED_ERROR_BAND. Plans whose speeds lie within it of each other are ranked
    # by memory headroom (ranking.py).
    error_band: float | None = None
    # A preset's leave-one-out errors on its published runs, the in-sample one beside them
    # (held_out.py; tests/unit/test_plan_published.py computes them); None: no published run.
    held_out: HeldOutBand | None = None
    # A measured machine times the model's own parts on itself (measure/part_timing.py) instead of
    # dividing their FLOPs by a rate: on a CPU the norms, attention and elementwise ops, and
    # DTensor's dispatch under tensor parallelism, are no small share of a block.
    times_the_model: bool = False
    # Seconds each collective or pipeline message costs besides its bytes (a small message's time).
    # 0 for the GPU presets: NCCL's microseconds are nothing against their steps.
    collective_latency: float = 0.0
    # Whether FSDP/DDP traffic runs beside the compute (NCCL's kernels on a GPU do). A CPU rank on
    # one core runs gloo's copies and reductions in place of its compute: none of it hides.
    overlaps_communication: bool = True
    # Seconds AdamW's update spends per parameter tensor more when parameters are DTensors (FSDP,
    # DDP, tensor parallelism): DTensor's dispatch per op. 0 for the GPU presets, whose updates are
    # a few kernels per tensor group.
    dtensor_update_overhead: float = 0.0
    # Each collective's measured time by size (a measured machine: gloo's all-gather and
    # reduce-scatter on a CPU reach a fraction of its send/receive rate, and differ from each
    # other); None: bytes over the link plus `collective_latency`, as a ring on NCCL runs.
    collective_times: CollectiveTimes | None = None

    @property
    def band(self) -> float:
        """The error band the planner states for its speed predictions on this hardware."""
        return C.UNCALIBRATED_ERROR_BAND if self.error_band is None else self.error_band

    def peak_for(self, fp32: bool) -> float:
        """The peak the compute dtype runs at."""
        if not fp32:
            return self.peak_flops
        return self.peak_fp32_flops if self.peak_fp32_flops is not None else self.peak_flops / 2

    def __post_init__(self):
        for name in ("peak_flops", "memory_bytes", "intra_node_bandwidth", "inter_node_bandwidth", "memory_bandwidth"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Hardware {self.name!r}: {name} must be a positive number, got {value!r}")
        if not isinstance(self.collective_latency, (int, float)) or self.collective_latency < 0:
            raise ValueError(
                f"Hardware {self.name!r}: collective_latency must be seconds >= 0, got {self.collective_latency!r}"
            )


# NVLink figures are the datasheets' bidirectional totals halved; the network is one NIC per GPU.
# The achievable fraction is fitted per part on the published runs docs/plan.md lists (each run's
# whole layout pinned, tests/unit/test_plan_published.py), minimising the largest error
# (held_out.balanced_fraction); the band covers the leave-one-out errors (each run predicted at the
# fraction refitted without it, held_out.leave_one_out), rounded up to a whole percent: the largest
# in-sample error understates how far a run the fit did not see stands. The H100 runs at two power
# limits in them, fitted apart: torchtitan's 96 GB parts at 500 W (HBM2e) and the 80 GB SXM5 at its
# 700 W TDP (HBM3). The H200, the same chip at 700 W, borrows the 700 W fit and band: no H200 run is
# fitted.
_H100_500W = dict(
    achievable_fraction=0.37,
    error_band=0.09,
    held_out=HeldOutBand(low=-0.070, high=0.081, runs=4, in_sample=0.065),
    fitted_on="torchtitan's Llama 3.1 8B on 8 H100 (eager and compiled) and on 128, FSDP with selective "
    "checkpointing, and its 70B on 256, FSDP 32 x TP 8 with sequence parallelism (96 GB parts at 500 W: "
    "benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3; its PR #1299)",
)
_H100_700W = dict(
    achievable_fraction=0.445,
    error_band=0.15,
    held_out=HeldOutBand(low=-0.145, high=0.126, runs=3, in_sample=0.095),
    fitted_on="mesh3d's Llama 3.2 1B shape on one H100 80 GB SXM5, eager and compiled (docs/performance.md), "
    "and the Llama 3 paper's 405B on 8,192 (Table 4), which sets the upper side and the band: its layout is "
    "partly assumed (docs/plan.md); the 1B runs alone balance at 0.42 (+3.3 %, -2.1 %), and stand the 405B "
    "run 14.4 % low",
)
_H200 = dict(_H100_700W, fitted_on="no H200 run: the 700 W H100's fit, the same chip (" + _H100_700W["fitted_on"] + ")")


def _hopper(name: str, memory_bytes: int, memory_bandwidth: float, source: str, fit: dict) -> Hardware:
    """An H100-chip part (SXM: 989 TFLOP/s dense BF16, NVLink 4, a 400 Gb/s port per GPU) and its
    memory, with the fraction and band fitted at its power limit."""
    return Hardware(
        name,
        peak_flops=989e12,
        memory_bytes=memory_bytes,
        intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB,
        memory_bandwidth=memory_bandwidth,
        peak_fp32_flops=494.5e12,
        source=source,
        **fit,
    )


HARDWARE: dict[str, Hardware] = {
    "h100": _hopper(
        "h100",
        80 * GIB,
        3350 * GB,
        "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 (1,979 with sparsity), 80 GB HBM3 at "
        "3.35 TB/s, NVLink 4 900 GB/s; ConnectX-7 400 Gb/s per GPU (DGX H100)",
        _H100_700W,
    ),
    "h100-96gb": _hopper(
        "h100-96gb",
        96 * GB,
        2400 * GB,
        "The H100 96 GB of Meta's Grand Teton hosts, torchtitan's benchmark machine "
        "(benchmarks/llama3_h100_202412_torchtitan.md): 96 GB HBM2e at 2.4 TB/s, a 500 W power limit "
        "(the SXM5's 700 W TDP), 400 Gb/s RDMA per GPU; the SXM5's 989 TFLOP/s dense BF16 as the peak",
        _H100_500W,
    ),
    "h200": _hopper(
        "h200",
        141 * GB,
        4800 * GB,
        "NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; "
        "ConnectX-7 400 Gb/s per GPU (DGX H200)",
        _H200,
    ),
    "a100-80gb": Hardware(
        "a100-80gb",
        peak_flops=312e12,
        memory_bytes=80 * GIB,
        intra_node_bandwidth=300 * GB,
        inter_node_bandwidth=25 * GB,
        memory_bandwidth=2039 * GB,
        peak_fp32_flops=156e12,
        source="NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s dense BF16, 80 GB HBM2e at 2,039 GB/s, NVLink 3 "
        "600 GB/s; HDR InfiniBand 200 Gb/s per GPU (DGX A100)",
        achievable_fraction=0.641,
        fitted_on="torchtitan's Llama 2 13B, Llama 3 8B and 70B on 64 A100, FSDP (docs/performance.md "
        "before its PR #800): mesh3d's own stack (FSDP2, SDPA's flash attention)",
        error_band=0.14,
        held_out=HeldOutBand(low=-0.135, high=0.121, runs=7, in_sample=0.091),
    ),
    "b200": Hardware(
        "b200",
        peak_flops=2.25e15,
        memory_bytes=180 * GB,
        intra_node_bandwidth=900 * GB,
        inter_node_bandwidth=50 * GB,
        memory_bandwidth=7700 * GB,
        peak_fp32_flops=1.125e15,
        source="NVIDIA DGX B200 datasheet: 72 PFLOP/s FP8 training per 8 GPUs (2.25 PFLOP/s dense BF16 each), "
        "1,440 GB HBM3e per 8 GPUs at 7.7 TB/s each, NVLink 5 1.8 TB/s; ConnectX-7 400 Gb/s per GPU",
        fitted_on="no published run: constants.ACHIEVABLE_COMPUTE_FRACTION",
    ),
}
