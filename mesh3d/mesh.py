"""The device mesh: ("pp", "dp", "tp"), or ("pp", "dp", "cp", "tp") with context parallelism;
pp outermost and tp innermost (the axes, their order and sizes: axes.py; the default process group
they are built on: distributed/process_group.py).

Global rank r sits at coordinates (pp_rank, dp_rank, tp_rank) with
r = (pp_rank * dp + dp_rank) * tp + tp_rank, so the ranks of one tensor-parallel group are
consecutive (one node, fast links) and the pipeline axis is the one that crosses nodes; a cp axis
sits between dp and tp: r = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank.
"""

from __future__ import annotations

from collections.abc import Hashable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mesh3d.axes import ALL_AXES, AXES, DATA_DIM, EXPERT_AXIS, EXPERT_DIMS, data_dims, describe, mesh_dims, stage_size
from mesh3d.axes import resolve_sizes as resolve_axis_sizes
from mesh3d.distributed.agree import check_same_everywhere
from mesh3d.distributed.group_kinds import axis_lists, can_split, device_mesh_groups_by_kind, groups_by_kind
from mesh3d.distributed.printed_once import print_agreed_errors_once
from mesh3d.distributed.process_group import (
    BACKEND_FOR_DEVICE,
    DEFAULT_TIMEOUT,
    as_timeout,
    default_timeout,
    group_options,
    init_default_group,
    mesh_group_options,
    pick_device,
    start_host_group,
    world_size_before_init,
)

MESH_DIM_NAMES = ("pp", "dp", "tp")  # the mesh's dims without context parallelism (axes.mesh_dims)


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
        self._own_groups: dict[tuple[str, Hashable], dist.ProcessGroup | None] = {}
        # dp and cp flattened into one dim (a collective: made here, by every rank, in one order)
        data = data_dims(sizes)
        with device_mesh_groups_by_kind():
            self._data_mesh = (
                mesh[data[0]] if len(data) == 1 else mesh[data]._flatten(DATA_DIM, group_options(device, timeout))
            )
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
        Made once per size, its groups by kind (group_kinds.py): every rank asks in the same order."""
        if dp_shard not in self._hybrid_meshes:
            names = ("dp_replicate", "dp_shard" if self.cp == 1 else "dp_shard_cp")
            options = dict.fromkeys(names, group_options(self.device, self.timeout))
            # dp x cp in rank order: groups of dp_shard x cp consecutive ones are dp_shard dp ranks with their cp ranks
            sizes = (self.dp // dp_shard, dp_shard * self.cp)
            with device_mesh_groups_by_kind():
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

        Every rank must ask for the same new member lists in the same order. Made as one kind
        (group_kinds.py): each rank registers one group, so the groups made after it, named by
        that count, keep one name on all their members. Returns None on ranks outside `members`.
        """
        key = tuple(sorted(members))
        if key not in self._subgroups:
            options = group_options(self.device, self.timeout)
            made = groups_by_kind({key: [list(key)]}, self.timeout, "mesh3d subgroup", *options)
            self._subgroups[key] = made[key]
        return self._subgroups[key] if self.rank in key else None

    def own_groups(
        self, purpose: str, kinds: dict[Hashable, list[list[int]]]
    ) -> dict[Hashable, dist.ProcessGroup | None]:
        """This rank's group of each kind of `kinds` (key -> member lists that never overlap, global
        ranks), groups no other traffic shares, created once per (purpose, key) and then reused: on
        NCCL each its own communicator and stream, so its operations never wait behind another
        group's in issue order (docs/design.md, "Communicators"). One call per kind (fewer: kinds
        whose ranks do not overlap share one), not one per group (group_kinds.py): every rank asks
        for the same purposes and kinds in the same order. None where this rank is in none of a
        kind's lists.
        """
        new = {key: lists for key, lists in kinds.items() if (purpose, key) not in self._own_groups}
        if new:
            # The description names the groups in NCCL's watchdog lines and flight-recorder dumps.
            made = groups_by_kind(new, self.timeout, f"mesh3d {purpose}", *group_options(self.device, self.timeout))
            self._own_groups.update({(purpose, key): group for key, group in made.items()})
        return {key: self._own_groups[(purpose, key)] for key in kinds}

    def own_group(self, purpose: str, members: list[int]) -> dist.ProcessGroup | None:
        """A group over `members` (global ranks) that no other traffic shares: `own_groups` with one
        kind of one list. Every rank asks for the same purposes and members in the same order;
        None on ranks outside `members`."""
        key = tuple(sorted(members))
        return self.own_groups(purpose, {key: [list(key)]})[key]

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
    sizes = resolve_axis_sizes(world_size_before_init(), pp=pp, dp=dp, tp=tp, cp=cp, ep=ep)
    dims = mesh_dims(sizes)
    timeout = as_timeout(timeout)
    device = pick_device(device, backend)
    if backend is None:
        backend = BACKEND_FOR_DEVICE[device.type]
    if not dist.is_initialized():
        init_default_group(backend, device, timeout)
    else:
        existing = dist.get_backend()  # may be a per-device list such as "cpu:gloo,cuda:nccl"
        if backend not in existing:
            raise ValueError(
                f"build_mesh: the process group already runs backend {existing!r}, which does not match "
                f"{backend!r} (for device {device}); pass device=/backend= that match the existing group"
            )
        backend = existing
    print_agreed_errors_once(dist.get_rank())  # an error the ranks agreed on: rank 0's traceback only
    start_host_group(backend, default_timeout(backend, timeout))
    # Ranks that asked for different layouts would build misaligned groups and hang later.
    check_same_everywhere(tuple(sizes[axis] for axis in ALL_AXES), _describe_layouts)
    shape = tuple(sizes[dim] for dim in dims)
    mesh = _device_mesh(device, shape, dims, timeout, backend)
    expert_mesh = None
    if sizes[EXPERT_AXIS] > 1:
        # A stage's ranks are consecutive global ranks, so (pp, edp, ep) is the world in rank order.
        expert_shape = (sizes["pp"], stage_size(sizes) // sizes[EXPERT_AXIS], sizes[EXPERT_AXIS])
        expert_mesh = _device_mesh(device, expert_shape, EXPERT_DIMS, timeout, backend)
    return Layout(mesh, device, backend, default_timeout(backend, timeout), expert_mesh)


def _device_mesh(
    device: torch.device, shape: tuple[int, ...], dims: tuple[str, ...], timeout: timedelta | None, backend: str
) -> DeviceMesh:
    """The DeviceMesh of `shape` over the world in rank order, its groups made one call per dim.

    Where the default group can be split (NCCL on a bound device), torch's init_device_mesh already
    makes each dim's groups with one split. Elsewhere it would call new_group once per group of the
    world (3,200 calls at 16,384 ranks), so each rank makes its own group per dim instead
    (group_kinds.py) and the mesh is built from them."""
    if can_split():
        return init_device_mesh(
            device.type, shape, mesh_dim_names=dims, backend_override=mesh_group_options(device, timeout, dims)
        )
    name, options = group_options(device, default_timeout(backend, timeout))
    groups = [
        groups_by_kind({dim: axis_lists(shape, axis)}, default_timeout(backend, timeout), f"mesh_{dim}", name, options)[
            dim
        ]
        for axis, dim in enumerate(dims)
    ]
    ranks = torch.arange(dist.get_world_size()).reshape(shape)
    return DeviceMesh.from_group(groups, device.type, mesh=ranks, mesh_dim_names=dims)


def layout_or_mesh(layout: Layout | None, **sizes: int | None) -> Layout:
    """`layout` if given (ValueError where a size given beside it differs), else `build_mesh` of the
    sizes given (None: build_mesh's default): parallelize's two ways of being told the layout."""
    given = {axis: size for axis, size in sizes.items() if size is not None}
    if layout is None:
        return build_mesh(**given)
    clash = {k: v for k, v in given.items() if v != getattr(layout, k)}
    if clash:
        raise ValueError(f"parallelize: got a layout {layout!r} and different sizes {clash}; pass one or the other")
    return layout
