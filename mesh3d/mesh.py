"""The device mesh: ("pp", "dp", "tp"), or ("pp", "dp", "cp", "tp") with context parallelism;
pp outermost and tp innermost (the axes, their order and sizes: axes.py).

Global rank r sits at coordinates (pp_rank, dp_rank, tp_rank) with
r = (pp_rank * dp + dp_rank) * tp + tp_rank, so the ranks of one tensor-parallel group are
consecutive (one node, fast links) and the pipeline axis is the one that crosses nodes; a cp axis
sits between dp and tp: r = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mesh3d.axes import ALL_AXES, AXES, DATA_DIM, EXPERT_AXIS, EXPERT_DIMS, data_dims, describe, mesh_dims, stage_size
from mesh3d.axes import resolve_sizes as resolve_axis_sizes
from mesh3d.distributed.agree import check_same_everywhere
from mesh3d.distributed.host_group import use_host_group
from mesh3d.distributed.nccl_watchdog import set_watchdog_defaults
from mesh3d.distributed.printed_once import print_agreed_errors_once
from mesh3d.distributed.rendezvous import attempt_store, uses_agent_store

MESH_DIM_NAMES = ("pp", "dp", "tp")  # the mesh's dims without context parallelism (axes.mesh_dims)
# torch's own default for a process group that is given no timeout (gloo and NCCL alike).
DEFAULT_TIMEOUT = dist.default_pg_timeout
_BACKEND_FOR_DEVICE = {"cuda": "nccl", "cpu": "gloo"}


class Layout:
    """This rank's place in the mesh, and the mesh itself.

    Attributes:
        mesh: the DeviceMesh with dims ("pp", "dp", "tp"), or ("pp", "dp", "cp", "tp") when cp > 1.
        pp, dp, cp, tp: the size of each axis (cp is 1 without context parallelism).
        pp_rank, dp_rank, cp_rank, tp_rank: this rank's coordinate on each axis.
        rank, world_size: global rank and world size.
        device: the torch.device this rank computes on.
        backend: the process-group backend ("gloo" or "nccl").
        timeout: how long a collective or P2P wait lasts before it raises (the groups' timeout).
        ep, ep_rank: expert parallelism's size and this rank's place in its group (axes.py): 1 and
            0 without it.
        expert_mesh: the ("pp", "edp", "ep") mesh of expert parallelism, None when ep = 1.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        device: torch.device,
        backend: str,
        timeout: timedelta = DEFAULT_TIMEOUT,
        expert_mesh: DeviceMesh | None = None,
    ):
        dims = tuple(mesh.mesh_dim_names or ())
        shape = dict(zip(dims, (int(s) for s in mesh.shape)))
        sizes = {axis: shape.get(axis, 1) for axis in AXES}
        if dims != mesh_dims(sizes):
            raise ValueError(f"Layout needs a mesh with dims {mesh_dims(sizes)}, got {mesh.mesh_dim_names}")
        self.mesh = mesh
        self.device = device
        self.backend = backend
        self.timeout = timeout
        self.dims = dims
        self.sizes = sizes
        self.pp, self.dp, self.cp, self.tp = (sizes[axis] for axis in AXES)
        at = dict(zip(dims, (int(c) for c in mesh.get_coordinate())))
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = (at.get(axis, 0) for axis in AXES)
        if expert_mesh is not None and tuple(expert_mesh.mesh_dim_names or ()) != EXPERT_DIMS:
            raise ValueError(f"Layout needs an expert mesh with dims {EXPERT_DIMS}, got {expert_mesh.mesh_dim_names}")
        self.expert_mesh = expert_mesh
        self.ep = int(expert_mesh.size(EXPERT_DIMS.index(EXPERT_AXIS))) if expert_mesh is not None else 1
        sizes[EXPERT_AXIS] = self.ep
        self.ep_rank = self.stage_index % self.ep
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # The mesh's own groups serve any subgroup that spans an axis. Every rank records every
        # axis group (None where it is not a member), so all ranks agree on which are new.
        self._subgroups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for dim in dims:
            for ranks in self.axis_groups(dim):
                mine = mesh.get_group(dim) if self.rank in ranks else None
                self._subgroups.setdefault(tuple(sorted(ranks)), mine)
        self._own_groups: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup | None] = {}
        # dp and cp flattened into one dim (a collective: made here, by every rank, in one order)
        data = data_dims(sizes)
        self._data_mesh = mesh[data[0]] if len(data) == 1 else mesh[data]._flatten(DATA_DIM, _options(device, timeout))
        self._hybrid_meshes: dict[int, DeviceMesh] = {}

    @property
    def coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate on each mesh dim: (pp_rank, dp_rank, tp_rank), or
        (pp_rank, dp_rank, cp_rank, tp_rank) when cp > 1."""
        return tuple(getattr(self, f"{dim}_rank") for dim in self.dims)

    @property
    def stage_index(self) -> int:
        """This rank's place among the ranks that share its pipeline stage (dp x cp x tp), in rank order."""
        return (self.dp_rank * self.cp + self.cp_rank) * self.tp + self.tp_rank

    @property
    def expert_replicas(self) -> int:
        """How many ranks of a stage hold the same experts: dp x cp x tp / ep."""
        return stage_size(self.sizes) // self.ep

    @property
    def data_parallel_size(self) -> int:
        """How many ranks at one pipeline stage and tp rank hold the same parameters: dp x cp."""
        return self.dp * self.cp

    @property
    def data_mesh(self) -> DeviceMesh:
        """The 1-D mesh data parallelism runs on: the dp dim, or dp and cp flattened into one
        ("dp_cp") when cp > 1 (context-parallel ranks hold the same parameters, so FSDP shards and
        gradients are reduced over both)."""
        return self._data_mesh

    def hybrid_data_mesh(self, dp_shard: int) -> DeviceMesh:
        """The 2-D mesh HSDP runs on, ("dp_replicate", "dp_shard"), or ("dp_replicate", "dp_shard_cp")
        with cp > 1: dp's ranks in groups of `dp_shard` consecutive ones (one node, when they fit),
        each group (with its cp ranks) sharding the parameters, the dp / dp_shard groups holding
        replicas. Sliced from the layout's own mesh, so tensor parallelism's DTensors compose with it.
        Made once per size; a collective over the whole world the first time (every rank asks in the
        same order)."""
        if dp_shard not in self._hybrid_meshes:
            names = ("dp_replicate", "dp_shard" if self.cp == 1 else "dp_shard_cp")
            options = dict.fromkeys(names, _options(self.device, self.timeout))
            # dp x cp in rank order: groups of dp_shard x cp consecutive ones are dp_shard dp ranks with their cp ranks
            sizes = (self.dp // dp_shard, dp_shard * self.cp)
            self._hybrid_meshes[dp_shard] = self.data_mesh._unflatten(0, sizes, names, backend_override=options)
        return self._hybrid_meshes[dp_shard]

    def data_group(self) -> dist.ProcessGroup:
        """The process group of the data-parallel ranks (dp x cp) of this rank: see `data_mesh`."""
        return self.data_mesh.get_group()

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group of this rank along one mesh dim ("pp", "dp", "cp" when cp > 1, or "tp")."""
        return self.mesh.get_group(dim)

    def group_ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along one mesh dim, in mesh order."""
        return dist.get_process_group_ranks(self.group(dim))

    def rank_at(self, *coordinate: int, **by_name: int) -> int:
        """The global rank at mesh coordinates, one per mesh dim as `coordinate` lists them, given in
        order or by name (`pp_rank=`, `dp_rank=`, `cp_rank=`, `tp_rank=`)."""
        if by_name:
            coordinate = (*coordinate, *(by_name.pop(f"{dim}_rank") for dim in self.dims[len(coordinate) :]))
            if by_name:
                raise ValueError(f"rank_at: unknown coordinates {sorted(by_name)}; the mesh's dims are {self.dims}")
        if len(coordinate) != len(self.dims):
            raise ValueError(f"rank_at takes one coordinate per mesh dim {self.dims}, got {coordinate}")
        return int(self.mesh.mesh[tuple(coordinate)])

    def coordinate_of(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinates of global rank `rank`, one per mesh dim (as `coordinate`)."""
        return tuple(int(i) for i in (self.mesh.mesh == rank).nonzero()[0])

    def axis_groups(self, dim: str) -> list[list[int]]:
        """Every group of the mesh along `dim`, as lists of global ranks (one per other coordinate)."""
        axis = self.dims.index(dim)
        ranks = self.mesh.mesh.movedim(axis, -1)
        return ranks.reshape(-1, ranks.shape[-1]).tolist()

    def subgroup(self, members: list[int]) -> dist.ProcessGroup | None:
        """A process group over `members` (global ranks), created once per Layout and then reused.

        Creating one is a collective over the whole world: every rank must ask for the same new
        member lists in the same order. Returns None on ranks outside `members`.
        """
        key = tuple(sorted(members))
        if key not in self._subgroups:
            self._subgroups[key] = dist.new_group(list(key), timeout=self.timeout)
        return self._subgroups[key] if self.rank in key else None  # new_group gives non-members a marker

    def own_group(self, purpose: str, members: list[int]) -> dist.ProcessGroup | None:
        """A process group over `members` (global ranks) that no other traffic shares, created once
        per (purpose, members) and then reused: on NCCL its own communicator and stream, so its
        operations never wait behind another group's in issue order (docs/design.md,
        "Communicators"). A collective over the whole world, like `subgroup`: every rank asks for
        the same purposes and member lists in the same order. Returns None on ranks outside `members`.
        """
        key = (purpose, tuple(sorted(members)))
        if key not in self._own_groups:
            # The description names the group in NCCL's watchdog lines and flight-recorder dumps.
            desc = f"mesh3d {purpose} ranks {','.join(map(str, key[1]))}"
            self._own_groups[key] = dist.new_group(list(key[1]), timeout=self.timeout, group_desc=desc)
        return self._own_groups[key] if self.rank in key[1] else None

    def __repr__(self) -> str:
        where = ", ".join(f"{dim} {getattr(self, f'{dim}_rank')}" for dim in self.dims)
        return (
            f"Layout({describe(self.sizes)}, rank={self.rank}/{self.world_size}, "
            f"coordinate=({where}), device={self.device}, backend={self.backend})"
        )


def resolve_sizes(pp: int, dp: int, tp: int, world_size: int, cp: int = 1) -> tuple[int, ...]:
    """Check the sizes against the world size and resolve dp=-1 to "the rest of the world":
    (pp, dp, tp), or (pp, dp, cp, tp) when cp > 1 (axes.resolve_sizes, whose arithmetic it is).

    Pure arithmetic, no communication, so every rank raises the same error before any collective.
    """
    given = {"pp": pp, "dp": dp, "tp": tp} | ({} if cp == 1 else {"cp": cp})
    sizes = resolve_axis_sizes(world_size, **given)
    return tuple(sizes[dim] for dim in mesh_dims(sizes))


def _launched_by_torchrun() -> bool:
    return bool(os.environ.get("RANK")) and bool(os.environ.get("WORLD_SIZE"))


def _world_size_before_init() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if _launched_by_torchrun() else 1


def _pick_device(device: str | torch.device | None, backend: str | None = None) -> torch.device:
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


def _as_timeout(timeout: float | timedelta | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"build_mesh: timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return timedelta(seconds=timeout)


def _init_default_group(backend: str, device: torch.device, timeout: timedelta | None) -> None:
    device_id = device if device.type == "cuda" else None
    if "nccl" in backend:
        set_watchdog_defaults()  # read by torch when the NCCL group starts (nccl_watchdog.py)
    if _launched_by_torchrun() and uses_agent_store():
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
    elif _launched_by_torchrun():
        # Started by torchrun (or anything that sets its environment variables).
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)
    else:
        # A plain single process: a private in-memory store, no ports, no environment needed.
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id
        )


def _describe_layouts(everyone: list[tuple[int, ...]]) -> str:
    listing = ", ".join(f"rank {r}: {describe(dict(zip(ALL_AXES, sizes)), ' ')}" for r, sizes in enumerate(everyone))
    return f"build_mesh: ranks asked for different layouts ({listing}); pass the same sizes on every rank"


def build_mesh(
    pp: int = 1,
    dp: int = -1,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    *,
    device: str | torch.device | None = None,
    backend: str | None = None,
    timeout: float | timedelta | None = None,
) -> Layout:
    """Build the ("pp", "dp", "tp") device mesh, ("pp", "dp", "cp", "tp") when cp > 1, and
    return this rank's Layout.

    Starts the default process group from the torchrun environment when none exists, or as a
    private world of one when there is no torchrun environment. Picks CUDA+NCCL when GPUs are
    present and CPU+gloo otherwise, and CPU whenever the process group is (or `backend` asks for)
    gloo alone; `device` and `backend` override that. On NCCL it sets the watchdog's defaults
    before the group starts and adds a gloo group over the world for the CPU-side checks
    (docs/reliability.md#on-nccl).

    Args:
        pp: pipeline-parallel degree (outermost dim).
        dp: data-parallel degree; -1 takes the rest of the world.
        tp: tensor-parallel degree (innermost dim: a tp group is consecutive global ranks).
        cp: context-parallel degree: each sequence is cut over cp ranks (between dp and tp, so a
            cp group sits in a node next to tp); its ranks hold the same parameters, so data
            parallelism spans dp x cp. 1 (default) leaves the mesh as without it.
        ep: expert-parallel degree: each block's experts split over ep consecutive ranks of the ranks
            that share a stage (dp x cp x tp, which ep must divide), tokens sent to their experts'
            ranks all-to-all; the world size does not change. The ranks holding the same experts
            (dp x cp x tp / ep of them) shard them with FSDP. 1 (default): no expert mesh.
        device: "cpu", "cuda" (cuda:LOCAL_RANK, or cuda:0 when the process sees one GPU only) or
            "cuda:N"; default: CUDA when available, unless the process group is gloo.
        backend: process-group backend; default: "nccl" for CUDA, "gloo" for CPU.
        timeout: seconds (or a timedelta) any collective or P2P wait may last before it raises,
            for the default process group when this call starts it (and the groups the mesh
            creates); default: torch's (30 minutes). See docs/reliability.md.

    Raises:
        ValueError: sizes below 1, a dp=-1 that does not divide, or a product that is not the world
            size (raised on every rank before any collective), or ranks that asked for different
            sizes (raised on every rank, after one small all-gather).

    A rank whose own sizes are invalid raises at once while ranks with valid (different) sizes go
    on to start the process group; under torchrun, the failed rank ends the job. Pass the same
    sizes on every rank.
    """
    sizes = resolve_axis_sizes(_world_size_before_init(), pp=pp, dp=dp, tp=tp, cp=cp, ep=ep)
    dims = mesh_dims(sizes)
    timeout = _as_timeout(timeout)
    device = _pick_device(device, backend)
    if backend is None:
        backend = _BACKEND_FOR_DEVICE[device.type]
    if not dist.is_initialized():
        _init_default_group(backend, device, timeout)
    else:
        existing = dist.get_backend()  # may be a per-device list such as "cpu:gloo,cuda:nccl"
        if backend not in existing:
            raise ValueError(
                f"build_mesh: the process group already runs backend {existing!r}, which does not match "
                f"{backend!r} (for device {device}); pass device=/backend= that match the existing group"
            )
        backend = existing
    print_agreed_errors_once(dist.get_rank())  # an error the ranks agreed on: rank 0's traceback only
    _start_host_group(backend, _default_timeout(backend, timeout))
    # Ranks that asked for different layouts would build misaligned groups and hang later.
    check_same_everywhere(tuple(sizes[axis] for axis in ALL_AXES), _describe_layouts)
    shape = tuple(sizes[dim] for dim in dims)
    mesh = init_device_mesh(
        device.type, shape, mesh_dim_names=dims, backend_override=_with_timeout(device, timeout, dims)
    )
    expert_mesh = None
    if sizes[EXPERT_AXIS] > 1:
        # A stage's ranks are consecutive global ranks, so (pp, edp, ep) is the world in rank order.
        expert_shape = (sizes["pp"], stage_size(sizes) // sizes[EXPERT_AXIS], sizes[EXPERT_AXIS])
        expert_mesh = init_device_mesh(
            device.type,
            expert_shape,
            mesh_dim_names=EXPERT_DIMS,
            backend_override=_with_timeout(device, timeout, EXPERT_DIMS),
        )
    return Layout(mesh, device, backend, _default_timeout(backend, timeout), expert_mesh)


def _start_host_group(backend: str, timeout: timedelta) -> None:
    """On NCCL, a gloo group over the world for the CPU-side checks (distributed/host_group.py);
    every rank creates it here, in the same order."""
    use_host_group(dist.new_group(backend="gloo", timeout=timeout) if "nccl" in backend else None)


def _default_timeout(backend: str, timeout: timedelta | None) -> timedelta:
    if timeout is not None:
        return timeout
    return (default_pg_nccl_timeout if backend == "nccl" else None) or DEFAULT_TIMEOUT


def _with_timeout(device: torch.device, timeout: timedelta | None, dims: tuple[str, ...]) -> dict | None:
    """init_device_mesh's per-dim group options carrying `timeout`: torch gives the groups it creates
    for a mesh its own default (30 minutes), not the default group's timeout, and the pipeline's P2P
    and data parallelism's collectives run on those groups."""
    if timeout is None:
        return None
    return {dim: _options(device, timeout) for dim in dims}


def _options(device: torch.device, timeout: timedelta) -> tuple[str, object]:
    """A group's (backend, options) carrying `timeout`."""
    name = _BACKEND_FOR_DEVICE[device.type]
    options = dist.ProcessGroupNCCL.Options() if name == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return name, options
