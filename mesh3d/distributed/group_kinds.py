"""Process groups made by kind: one world-wide call per kind of group, not one per group.

A kind is a set of member lists that never overlap: every pp group of the mesh, or one pipeline
channel (pp positions i and j) in every pp group. `dist.new_group` is a call every rank of the
world makes for every group, members or not, so a mesh's groups cost each rank a call per group of
the whole world (33,920 at 16,384 ranks, issue 66) and, with NCCL's eager init, a communicator split
each. Here a kind costs one call:

- where the default group can be split (NCCL bound to a device, as build_mesh starts it on GPUs),
  `dist.split_group` over the kind's lists: one collective per kind, as DeviceMesh does per dim,
  a rank outside every list given a list of its own (below);
- elsewhere (gloo, torch's fake group of a dry run) each rank creates only its own list's group,
  synchronized among its members alone (`use_local_synchronization`): no world-wide call at all.

Kinds whose ranks do not overlap share one round (one call). torch names a member-synchronized
group by its ranks and by how many groups this process holds (is a member of), so members must
hold equally many: in each round a rank outside every list makes a group of itself alone (a few,
never used, no connection), and every rank goes through the same rounds in the same order, which
also keeps the members of each group arriving together (no rank waits on a group a member has yet
to reach). A plain `new_group` of some ranks registers a group on its members alone: mesh3d makes
none (`Layout.subgroup` is a kind too), and each call here first checks that every rank holds
as many groups, raising by name where a user's own left them apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed._mesh_layout import _MeshLayout
from torch.distributed.device_mesh import DeviceMesh

from mesh3d.distributed.host_group import host_group
from mesh3d.distributed.printed_once import agreed


def can_split() -> bool:
    """Whether the default group can be split into subgroups (torch's condition for split_group:
    a communicator bound to a device, eagerly made)."""
    default = dist.distributed_c10d._get_default_group()
    return getattr(default, "bound_device_id", None) is not None and torch.accelerator.is_available()


def rounds(kinds: dict[Hashable, Sequence[Sequence[int]]]) -> list[list[Hashable]]:
    """The kinds in rounds whose ranks never overlap, in the order given (first fit)."""
    placed: list[tuple[set[int], list[Hashable]]] = []
    for key, lists in kinds.items():
        ranks = {r for members in lists for r in members}
        if sum(len(members) for members in lists) != len(ranks):
            raise ValueError(f"group kind {key!r}: its member lists overlap ({list(lists)[:4]}...)")
        for used, keys in placed:
            if not used & ranks:
                used |= ranks
                keys.append(key)
                break
        else:
            placed.append((ranks, [key]))
    return [keys for _, keys in placed]


def groups_by_kind(
    kinds: dict[Hashable, Sequence[Sequence[int]]],
    timeout: timedelta,
    describe: str,
    backend: str | None = None,
    options: object | None = None,
) -> dict[Hashable, dist.ProcessGroup | None]:
    """This rank's group of each kind (None where it is in none of the kind's lists).

    Every rank of the world must call this with the same kinds in the same order. `describe`
    names the groups (NCCL's watchdog lines, flight-recorder dumps); `backend`/`options` as for
    `dist.new_group`.
    """
    _check_registered_alike(describe)
    rank = dist.get_rank()
    mine: dict[Hashable, dist.ProcessGroup | None] = dict.fromkeys(kinds)
    for keys in rounds(kinds):
        lists = [sorted(members) for key in keys for members in kinds[key]]
        if can_split():
            # every rank in some list, as on the other path: torch names a split group by how many
            # groups this process made before, so a rank left out would name its later groups
            # apart from their other members, whose NCCL rendezvous would then never meet
            covered = {r for members in lists for r in members}
            padded = lists + [[r] for r in range(dist.get_world_size()) if r not in covered]
            group = dist.split_group(split_ranks=padded, timeout=timeout, pg_options=options, group_desc=describe)
            group = group if rank in covered else None
        else:
            own = next((members for members in lists if rank in members), None)
            # outside every list: a group of this rank alone keeps its count of groups in step (above)
            group = dist.new_group(
                own or [rank],
                timeout=timeout,
                backend=backend,
                pg_options=options,
                use_local_synchronization=True,
                group_desc=describe,
            )
            group = group if own is not None else None
        for key in keys:
            if any(rank in members for members in kinds[key]):
                mine[key] = group
    return mine


def _check_registered_alike(describe: str) -> None:
    """Raise on every rank, rather than hang in a rendezvous, where the ranks hold different numbers
    of process groups, by which torch names the groups made next (one all-reduce of two ints)."""
    if dist.get_world_size() == 1:
        return
    held = len(dist.distributed_c10d._world.pg_names)
    extremes = torch.tensor([held, -held], dtype=torch.int64)  # host memory: the host group is gloo
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=host_group())
    most, fewest = int(extremes[0]), -int(extremes[1])
    if most != fewest:
        raise agreed(
            ValueError(
                f"making the {describe!r} groups: the ranks hold from {fewest} to {most} process groups, so the "
                "groups made next would take different names on their members and never meet: a "
                "torch.distributed.new_group of some ranks (or a destroy_process_group of one) registers or "
                "drops a group on its members alone. Make such groups after build_mesh with "
                "layout.subgroup(members) or layout.own_group(purpose, members), every rank calling it"
            )
        )


def axis_lists(shape: Sequence[int], axis: int) -> list[list[int]]:
    """The member lists of a mesh dim: global ranks in row-major order, one list per other coordinate."""
    ranks = torch.arange(int(torch.tensor(shape).prod())).reshape(tuple(shape)).movedim(axis, -1)
    return ranks.reshape(-1, shape[axis]).tolist()


@contextlib.contextmanager
def device_mesh_groups_by_kind() -> Iterator[None]:
    """While active, DeviceMesh's own group creation (a flatten or unflatten of a mesh dim) makes
    each new dim's groups as one kind (`groups_by_kind`) where torch would call `new_group` once per
    group over the whole world (gloo, the fake group); where the default group can split, torch's
    own path is already one `split_group` per dim and is left alone. Every rank enters it around
    the same DeviceMesh calls in the same order."""
    if can_split():
        yield
        return
    torchs = DeviceMesh.__dict__["_init_one_process_group"]

    def one_kind(sub_layout, rank_map, dim_name, backend_override):
        lists = _MeshLayout([sub_layout]).remap_to_tensor(rank_map).tolist()  # as torch lays them out
        backend, options = backend_override
        timeout = options._timeout if options is not None else dist.default_pg_timeout
        group = groups_by_kind({dim_name: lists}, timeout, f"mesh_{dim_name}", backend, options)[dim_name]
        return group.group_name if group is not None else None

    DeviceMesh._init_one_process_group = staticmethod(one_kind)
    try:
        yield
    finally:
        DeviceMesh._init_one_process_group = torchs
