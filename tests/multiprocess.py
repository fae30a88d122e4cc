"""Run a test function on N ranks in real processes (gloo, CPU) with a hard timeout.

`run_on_ranks(fn, world_size, *args)` starts `world_size` processes with the environment torchrun
would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), calls `fn(*args)` in
each, and returns the list of the ranks' return values. If any rank raises, it fails with that
rank's traceback (and every other failing rank's); if ranks are still running when the timeout
expires, or a few seconds after another rank failed (they are then usually stuck in a
collective), it kills them and fails naming them. A deadlock therefore costs seconds, not CI's
90 minutes. Under pytest every rank runs under NCCL's point-to-point rules (nccl_rules.py) unless
MESH3D_NCCL_RULES=0; a script (bench/) measures plain gloo unless MESH3D_NCCL_RULES=1.

Processes come from a fork server that has imported torch once, so a launch costs a fork, not a
fresh `import torch` per rank; `fn` must be importable (defined at module level).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

import nccl_rules

# CUDA_VISIBLE_DEVICES as the suite found it ("all": unset), kept while hide_gpus hides them.
VISIBLE_GPUS_ENV = "MESH3D_TESTS_VISIBLE_GPUS"

# Ranks that are still running this long after another rank failed are treated as stuck.
GRACE_AFTER_FAILURE_S = 5.0

_context = None


class RankFailure(AssertionError):
    """One or more ranks raised, or did not finish in time."""


def hide_gpus() -> None:
    """Show this process, and every process it starts, no GPU (tests/conftest.py calls it first).

    On a machine with GPUs, build_mesh() with no device picks CUDA and NCCL, and the ranks of one
    test would share one GPU (NCCL refuses: "Duplicate GPU detected"); the CPU suite must stay on
    the CPU. The GPU tests' ranks get the devices back (gpu_cases.run_on_gpu_ranks)."""
    os.environ.setdefault(VISIBLE_GPUS_ENV, os.environ.get("CUDA_VISIBLE_DEVICES", "all"))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


# Imported once, in the fork server, before it forks the ranks: each rank of each launch would
# otherwise import them itself (mesh3d about 1 s of CPU, transformers' modeling about 2 s; the suite
# starts some thousand ranks on two cores). A module that is not installed is skipped.
PRELOADED = [
    "torch",
    "torch.distributed",
    "numpy",
    "einops",
    "mesh3d",
    "examples.llama.model",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
]


def _mp_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOADED)
    return _context


# The suite runs on two pytest-xdist workers (pyproject.toml). A port the kernel picks (bind to 0) may
# go to the other worker's launch, or to gloo's own connections, between this check and the
# rendezvous store's bind. So each worker takes ports from a block of its own below Linux's
# ephemeral range (32768-60999), where the kernel never hands one out.
# A session without workers (`-n 0`, a script) takes a block by its process id, so that two such
# sessions side by side (a developer's run beside another's) rarely share one.
_PORT_BLOCK_START = 20000
_PORT_BLOCK_SIZE = 500
_WORKER_BLOCKS = 4
_ports_taken = 0


def free_port() -> int:
    """A localhost port nothing listens on, from this pytest worker's own block."""
    global _ports_taken
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None and worker[2:].isdigit():
        index = int(worker[2:]) % _WORKER_BLOCKS
    else:
        index = _WORKER_BLOCKS + os.getpid() % 20  # blocks up to 32000, below the ephemeral range
    base = _PORT_BLOCK_START + index * _PORT_BLOCK_SIZE
    for _ in range(_PORT_BLOCK_SIZE):
        port = base + _ports_taken % _PORT_BLOCK_SIZE
        _ports_taken += 1
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or still in TIME_WAIT from an earlier launch
                continue
            return port
    raise RuntimeError(f"no free port in {base}-{base + _PORT_BLOCK_SIZE - 1}")


def _rank_main(fn: Callable, args: tuple, rank: int, env: dict, results: Any) -> None:
    for name, value in env.items():  # None: the variable is removed in this rank
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        import torch

        torch.set_num_threads(1)
        if nccl_rules.enabled():  # NCCL's order over gloo (nccl_rules.py); MESH3D_NCCL_RULES=0 lifts it
            nccl_rules.install()
        profile_dir = os.environ.get("MESH3D_PROFILE_RANKS")  # a folder: each rank's cProfile lands there
        if profile_dir:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
            try:
                returned = fn(*args)
            finally:
                profiler.disable()
                profiler.dump_stats(os.path.join(profile_dir, f"{fn.__name__}-{os.getpid()}.prof"))
        else:
            returned = fn(*args)
        # Pickled here, by value: the queue's own pickler would share a tensor's storage through a
        # file descriptor that the parent fetches from this process, which may have exited by then.
        value = pickle.dumps(returned)
        results.put((rank, "ok", value))
        finished = True
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
        finished = False
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                if finished:
                    # Rank 0 hosts the rendezvous store: leaving while a peer still creates a group
                    # only its peers join (gloo connects through the store) resets that peer's
                    # connection. A rank whose peer failed waits here until the parent kills it.
                    dist.barrier()
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown of a broken group must not mask the result
            pass


def run_on_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str | None] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks; return each rank's result, indexed by rank. `env` is
    added to each rank's environment (a None value removes the variable there)."""
    ctx = _mp_context()
    results = ctx.Queue()
    port = free_port()
    procs = []
    # the suite tests NCCL's program under NCCL's rules; a benchmark times the program itself
    rules = os.environ.get(nccl_rules.ENV) or ("1" if "_pytest" in sys.modules else "0")
    for rank in range(world_size):
        rank_env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            nccl_rules.ENV: rules,
            **(env or {}),
        }
        proc = ctx.Process(target=_rank_main, args=(fn, args, rank, rank_env, results), daemon=True)
        proc.start()
        procs.append(proc)

    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    first_failure_at = None

    def record(rank: int, status: str, value: Any) -> None:
        nonlocal first_failure_at
        outcome.setdefault(rank, (status, value))  # the first word on a rank stands
        if status == "error" and first_failure_at is None:
            first_failure_at = time.monotonic()

    try:
        while len(outcome) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            if first_failure_at is not None and now - first_failure_at >= GRACE_AFTER_FAILURE_S:
                break
            try:
                record(*results.get(timeout=0.1))
                continue
            except queue.Empty:
                pass
            # A rank that exited without reporting (crash, os._exit, killed) has failed. Its report,
            # if any, was flushed before it exited: drain the queue once more before judging.
            silent = [r for r, p in enumerate(procs) if r not in outcome and not p.is_alive()]
            if silent:
                try:
                    while True:
                        record(*results.get_nowait())
                except queue.Empty:
                    pass
                for r in silent:
                    record(r, "error", f"process exited with code {procs[r].exitcode} without reporting")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=5)
        results.close()

    failed = sorted(r for r, (status, _) in outcome.items() if status == "error")
    stuck = [r for r in range(world_size) if r not in outcome]
    if failed or stuck:
        parts = []
        if stuck:
            why = f"after rank {failed[0]} failed" if failed else f"within the {timeout:.0f} s timeout"
            parts.append(f"ranks {stuck} of {world_size} did not finish {why} (killed)")
        for r in failed:
            parts.append(f"--- rank {r} raised:\n{outcome[r][1]}")
        raise RankFailure(f"{fn.__name__} on {world_size} ranks failed: " + "\n".join(parts))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]
