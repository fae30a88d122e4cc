"""`hardware="this-machine"`: the machine the planner runs on, measured by short micro-benchmarks.

Each rank of a CPU run computes on one thread (OMP_NUM_THREADS=1, as the tests and the examples
run), so the compute rate is a one-thread fp32 matmul of a transformer's shapes, and it is
already what a step reaches: `achievable_fraction` is 1. The link is gloo between two processes
of this machine (a send/receive of a few MiB each way), the memory the machine's RAM, the memory
bandwidth a large elementwise update. A few seconds in all, measured once per process.
"""

from __future__ import annotations

import functools
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mesh3d.planner.hardware import Hardware

MATMUL_SIZE = 512  # a square matmul of about a small model's width: the rate tiny models see
LINK_BYTES = 8 * 2**20
REPEATS = 5


@functools.cache
def measure_this_machine() -> Hardware:
    """This machine as a Hardware: one-thread matmul rate, gloo link, RAM, memory bandwidth."""
    flops = _matmul_rate()
    link = _gloo_bandwidth()
    return Hardware(
        "this-machine", peak_flops=flops, memory_bytes=_ram_bytes(), intra_node_bandwidth=link,
        inter_node_bandwidth=link, memory_bandwidth=_copy_bandwidth(), peak_fp32_flops=flops, achievable_fraction=1.0,
        source=f"measured here: {flops / 1e9:.1f} GFLOP/s one-thread fp32 matmul {MATMUL_SIZE}^3, "
               f"gloo {link / 1e9:.2f} GB/s between two processes",
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
        if rank == 0:
            result.put(2 * LINK_BYTES / seconds)
    finally:
        dist.destroy_process_group()


def _gloo_bandwidth() -> float:
    context = mp.get_context("spawn")
    result, port = context.Queue(), _free_port()
    procs = [context.Process(target=_link_rank, args=(r, port, result), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        bandwidth = result.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return bandwidth
