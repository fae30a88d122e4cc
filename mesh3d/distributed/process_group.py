"""The default process group started for build_mesh (mesh.py): which device and backend, the timeout
its groups carry, torchrun's environment or a private world of one.

A timeout given to build_mesh reaches every group: the default one, the gloo group of the CPU-side
checks (host_group.py), and the groups torch creates for a mesh (`mesh_group_options`).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout

from mesh3d.distributed.dry_world import FAKE_BACKEND, is_dry_run
from mesh3d.distributed.host_group import use_host_group
from mesh3d.distributed.nccl_watchdog import set_watchdog_defaults
from mesh3d.distributed.rendezvous import attempt_store, uses_agent_store

# torch's own default for a process group that is given no timeout (gloo and NCCL alike).
DEFAULT_TIMEOUT = dist.default_pg_timeout
BACKEND_FOR_DEVICE = {"cuda": "nccl", "cpu": "gloo"}


def launched_by_torchrun() -> bool:
    """Whether torchrun (or anything that sets its environment variables) started this process."""
    return bool(os.environ.get("RANK")) and bool(os.environ.get("WORLD_SIZE"))


def world_size_before_init() -> int:
    """The world size, known before the default process group exists: torchrun's, else 1."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def pick_device(device: str | torch.device | None, backend: str | None = None) -> torch.device:
    """The device this rank computes on (made current on CUDA): the one asked for, else
    `_default_device`'s; "cuda" without an index is this process's GPU."""
    if device is None:
        device = _default_device(backend)
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("build_mesh: device='cuda' was asked for, but CUDA is not available here")
        if device.index is None:
            device = torch.device("cuda", _local_device_index())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ValueError(f"build_mesh: device must be 'cpu' or 'cuda', got {device}")
    return device


def _default_device(backend: str | None) -> str:
    """CPU where the process group is (or is asked to be) gloo alone, so a CPU test suite runs
    unchanged on a machine with GPUs; else CUDA when it is there."""
    if backend is None and dist.is_initialized():
        backend = dist.get_backend()  # "gloo", "nccl", or a per-device list such as "cpu:gloo,cuda:nccl"
    if backend is not None and "nccl" not in backend:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _local_device_index() -> int:
    """This process's GPU: cuda:LOCAL_RANK, or cuda:0 when the launcher shows each process only
    its own GPU (CUDA_VISIBLE_DEVICES of one device, whatever LOCAL_RANK says)."""
    local_rank, visible = int(os.environ.get("LOCAL_RANK") or 0), torch.cuda.device_count()
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise ValueError(
            f"build_mesh: LOCAL_RANK={local_rank} but this process sees {visible} GPUs; start at most one "
            f"process per GPU (torchrun --nproc-per-node), or show each process its own GPU alone "
            f"(CUDA_VISIBLE_DEVICES)"
        )
    return local_rank


def as_timeout(timeout: float | timedelta | None) -> timedelta | None:
    """build_mesh's `timeout` (seconds or a timedelta; None: torch's default) as a timedelta."""
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"build_mesh: timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return timedelta(seconds=timeout)


def init_default_group(backend: str, device: torch.device, timeout: timedelta | None) -> None:
    """Start the default process group: from torchrun's environment, or as a private world of one."""
    device_id = device if device.type == "cuda" else None
    if "nccl" in backend:
        set_watchdog_defaults()  # read by torch when the NCCL group starts (nccl_watchdog.py)
    if launched_by_torchrun() and uses_agent_store():
        # torchrun's store outlives a restart: each attempt needs keys of its own (rendezvous.py).
        store = attempt_store(timeout or DEFAULT_TIMEOUT)
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
            device_id=device_id,
        )
    elif launched_by_torchrun():
        # Started by torchrun (or anything that sets its environment variables).
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)
    else:
        # A plain single process: a private in-memory store, no ports, no environment needed.
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id
        )


def start_host_group(backend: str, timeout: timedelta) -> None:
    """On NCCL, a gloo group over the world for the CPU-side checks (distributed/host_group.py);
    every rank creates it here, in the same order."""
    use_host_group(dist.new_group(backend="gloo", timeout=timeout) if "nccl" in backend else None)


def default_timeout(backend: str, timeout: timedelta | None) -> timedelta:
    """The timeout the groups carry: the one given, else torch's default for the backend."""
    if timeout is not None:
        return timeout
    return (default_pg_nccl_timeout if backend == "nccl" else None) or DEFAULT_TIMEOUT


def mesh_group_options(device: torch.device, timeout: timedelta | None, dims: tuple[str, ...]) -> dict | None:
    """init_device_mesh's per-dim group options carrying `timeout`: torch gives the groups it creates
    for a mesh its own default (30 minutes), not the default group's timeout, and the pipeline's P2P
    and data parallelism's collectives run on those groups."""
    if timeout is None:
        return None
    return {dim: group_options(device, timeout) for dim in dims}


def group_options(device: torch.device, timeout: timedelta) -> tuple[str, object]:
    """A group's (backend, options) carrying `timeout`; in a dry run, the fake backend's (which
    takes no options: gloo's would fail there, dry_world.py)."""
    if is_dry_run():
        return FAKE_BACKEND, None
    name = BACKEND_FOR_DEVICE[device.type]
    options = dist.ProcessGroupNCCL.Options() if name == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return name, options
