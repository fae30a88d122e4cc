"""`hardware="this-machine"`: the machine the planner runs on, measured by short micro-benchmarks.

Each rank of a CPU run computes on one thread (OMP_NUM_THREADS=1, as the tests and the examples
run), so the compute rate is a one-thread fp32 matmul of a transformer's shapes, and it is
already what a step reaches: `achievable_fraction` is 1. The link is gloo between two processes
of this machine (a send/receive of a few MiB each way) and the fixed time of one collective (a
small all-gather, reduce-scatter and all-reduce); the collectives data parallelism issues are
timed at several sizes too, since gloo's all-gather and reduce-scatter reach a fraction of its
send/receive rate and differ from each other (hardware.CollectiveTimes). The memory is the
machine's RAM, the memory bandwidth a large elementwise update. A few seconds in all, measured once per process.

On such a machine FLOPs over a matmul rate miss much of a step (norms, attention, elementwise ops,
DTensor's dispatch): the Hardware says `times_the_model`, and the planner times the model's own
parts on one thread (part_timing.time_model). Its ranks' gloo traffic does not overlap their compute
(`overlaps_communication=False`): each rank has one core.
"""

from __future__ import annotations

import functools
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mesh3d.planner import constants as C
from mesh3d.planner.hardware import CollectiveTimes, Hardware

MATMUL_SIZE = 512  # a square matmul of about a small model's width: the rate tiny models see
LINK_BYTES = 8 * 2**20
REPEATS = 5
LATENCY_ELEMENTS = 256  # a 1 KiB collective: its time is gloo's fixed cost, not bandwidth
LATENCY_ROUNDS = 20
OVERHEAD_TENSORS = 32
# Sizes (bytes of the whole tensor: an all-gather's output, a reduce-scatter's input) the collectives
# are timed at: a small collective's fixed cost, then a small model's module (FSDP gathers one block
# at a time) up to a large one's.
COLLECTIVE_BYTES = (4 * LATENCY_ELEMENTS, 64 * 2**10, 512 * 2**10, 2 * 2**20, 8 * 2**20)
COLLECTIVE_ROUNDS = 4


@functools.cache
def measure_this_machine() -> Hardware:
    """This machine as a Hardware: one-thread matmul rate, gloo link, RAM, memory bandwidth."""
    flops = _matmul_rate()
    link, latency, dtensor_update, collectives = _gloo_link()
    return Hardware(
        "this-machine",
        peak_flops=flops,
        memory_bytes=_ram_bytes(),
        intra_node_bandwidth=link,
        inter_node_bandwidth=link,
        memory_bandwidth=_copy_bandwidth(),
        peak_fp32_flops=flops,
        achievable_fraction=1.0,
        times_the_model=True,
        collective_latency=latency,
        overlaps_communication=False,
        dtensor_update_overhead=dtensor_update,
        collective_times=collectives,
        fitted_on="measured here: the model's own parts timed (docs/performance.md)",
        error_band=C.MEASURED_MACHINE_ERROR_BAND,
        source=f"measured here: {flops / 1e9:.1f} GFLOP/s one-thread fp32 matmul {MATMUL_SIZE}^3, "
        f"gloo {link / 1e9:.2f} GB/s and {latency * 1e6:.0f} us per small collective between two "
        f"processes ({_describe(collectives)}); AdamW +{dtensor_update * 1e6:.0f} us per DTensor parameter; "
        "the model's own parts timed "
        "on one thread",
    )


def _best_of(fn, repeats: int = REPEATS) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _matmul_rate() -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(MATMUL_SIZE, MATMUL_SIZE), torch.randn(MATMUL_SIZE, MATMUL_SIZE)
        seconds = _best_of(lambda: [a @ b for _ in range(4)])
    finally:
        torch.set_num_threads(threads)
    return 4 * 2 * MATMUL_SIZE**3 / seconds


def _copy_bandwidth() -> float:
    x = torch.ones(16 * 2**20)
    y = torch.empty_like(x)
    seconds = _best_of(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / seconds  # read and write


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _link_rank(rank: int, port: int, result) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        x = torch.ones(LINK_BYTES // 4)

        def exchange():
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)

        seconds = _best_of(exchange)
        small = torch.ones(LATENCY_ELEMENTS)
        gathered = torch.empty(2 * LATENCY_ELEMENTS)

        def collectives():  # the three the planner counts, each of a small message
            for _ in range(LATENCY_ROUNDS):
                dist.all_gather_single(gathered, small)
                dist.reduce_scatter_single(small, gathered)
                dist.all_reduce(small)

        latency = _best_of(collectives) / (3 * LATENCY_ROUNDS)
        times = _collective_times()
        overhead = _dtensor_update_overhead()
        if rank == 0:
            result.put((2 * LINK_BYTES / seconds, latency, overhead, times))
    finally:
        dist.destroy_process_group()


def _collective_times() -> CollectiveTimes:
    """The three collectives data parallelism issues, each timed at COLLECTIVE_BYTES between the two
    ranks, keyed by the bytes each rank sends (hardware.CollectiveTimes)."""
    points = {"all_gather": [], "reduce_scatter": [], "all_reduce": []}
    for size in COLLECTIVE_BYTES:
        whole, shard = torch.ones(size // 4), torch.ones(size // 8)
        runs = {
            "all_gather": (lambda: dist.all_gather_single(whole, shard), size / 2),
            "reduce_scatter": (lambda: dist.reduce_scatter_single(shard, whole), size / 2),
            "all_reduce": (lambda: dist.all_reduce(whole), size),
        }
        for kind, (run, sent) in runs.items():
            dist.barrier()
            seconds = _best_of(lambda: [run() for _ in range(COLLECTIVE_ROUNDS)]) / COLLECTIVE_ROUNDS
            points[kind].append((sent, seconds))
    return CollectiveTimes({kind: tuple(p) for kind, p in points.items()})


def _describe(times: CollectiveTimes) -> str:
    size = COLLECTIVE_BYTES[-1]
    return ", ".join(
        f"{kind.replace('_', '-')} of {size // 2**20} MiB {times.seconds(kind, sent) * 1e3:.1f} ms"
        for kind, sent in (("all_gather", size / 2), ("reduce_scatter", size / 2), ("all_reduce", size))
    )


def _dtensor_update_overhead() -> float:
    """Seconds AdamW spends per parameter tensor more when the parameters are DTensors (FSDP's
    shards, DDP's replicas, tensor-parallel shards) than plain tensors: DTensor's dispatch of each
    of the update's ops. Small tensors, so the difference is the dispatch, not the arithmetic."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))

    def update_seconds(params):
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        return _best_of(optimizer.step)

    plain = [torch.nn.Parameter(torch.zeros(8, 8)) for _ in range(OVERHEAD_TENSORS)]
    shards = [
        torch.nn.Parameter(distribute_tensor(torch.zeros(16, 8), mesh, [Shard(0)])) for _ in range(OVERHEAD_TENSORS)
    ]
    return max(0.0, update_seconds(shards) - update_seconds(plain)) / OVERHEAD_TENSORS


def _gloo_link() -> tuple[float, float, float, CollectiveTimes]:
    """Bytes/s of a large send/receive, seconds of a small collective, DTensor's overhead per
    parameter in AdamW's update, and the collectives' times by size, measured on two processes."""
    context = mp.get_context("spawn")
    result, port = context.Queue(), _free_port()
    procs = [context.Process(target=_link_rank, args=(r, port, result), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        measured = result.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return measured
