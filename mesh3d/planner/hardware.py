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
    # What a step's matmuls reach of the peak; None: constants.ACHIEVABLE_COMPUTE_FRACTION (a
    # datasheet peak). A measured machine ("this-machine") states 1: its peak is a rate reached.
    achievable_fraction: float | None = None
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
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "h100",
        peak_flops=989e12,
        memory_bytes=80 * GIB,
        intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB,
        memory_bandwidth=3350 * GB,
        peak_fp32_flops=494.5e12,
        source="NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 (1,979 with sparsity), 80 GB HBM3 at "
        "3.35 TB/s, NVLink 4 900 GB/s; ConnectX-7 400 Gb/s per GPU (DGX H100)",
    ),
    "h200": Hardware(
        "h200",
        peak_flops=989e12,
        memory_bytes=141 * GB,
        intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB,
        memory_bandwidth=4800 * GB,
        peak_fp32_flops=494.5e12,
        source="NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; "
        "ConnectX-7 400 Gb/s per GPU (DGX H200)",
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
    ),
}
