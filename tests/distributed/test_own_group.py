"""`Layout.own_group(purpose, members)` (docs/mesh.md): a group over the members alone, the same
group for the same members in any order, None elsewhere; messages on it reach only its members."""

from multiprocess import run_on_ranks


def _own_group():
    import torch
    import torch.distributed as dist

    import mesh3d

    layout = mesh3d.build_mesh(pp=1, dp=4, tp=1)
    group = layout.own_group("check", [1, 2])
    again = layout.own_group("check", [2, 1])
    if group is None:
        return None if again is None else "a group outside its members"
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    return total.item(), group is again


def test_own_group_is_its_members_alone_and_reused():
    assert run_on_ranks(_own_group, 4, timeout=120) == [None, (2.0, True), (2.0, True), None]
