"""`Layout.own_group(purpose, members)` and `subgroup(members)` (docs/mesh.md): a group over the members alone, the same
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


def _subgroup_then_hsdp():
    import torch
    import torch.distributed as dist

    import mesh3d

    layout = mesh3d.build_mesh(dp=4, timeout=60)
    pair = layout.subgroup([0, 1])
    assert (pair is not None) == (layout.rank in (0, 1))
    hybrid = layout.hybrid_data_mesh(2)  # as parallelize(dp_mode="hsdp", dp_shard=2) makes it, after
    sums = []
    for dim in ("dp_replicate", "dp_shard"):
        total = torch.ones(1)
        dist.all_reduce(total, group=hybrid.get_group(dim))
        sums.append((dist.get_process_group_ranks(hybrid.get_group(dim)), total.item()))
    return sums


def test_a_subgroup_keeps_later_member_made_groups_named_alike():
    """Layout.subgroup of some ranks, then HSDP's mesh (its groups made among their members alone,
    named by how many groups each rank holds): every rank holds one more, members or not, so the
    dp_replicate and dp_shard groups meet (a plain new_group of [0, 1] left ranks 2 and 3 a group
    short and their rendezvous apart, a timeout)."""
    per_rank = run_on_ranks(_subgroup_then_hsdp, 4, timeout=120)
    assert per_rank == [
        [([0, 2], 2.0), ([0, 1], 2.0)],
        [([1, 3], 2.0), ([0, 1], 2.0)],
        [([0, 2], 2.0), ([2, 3], 2.0)],
        [([1, 3], 2.0), ([2, 3], 2.0)],
    ]


def _a_users_subset_group_first():
    import torch.distributed as dist

    import mesh3d

    dist.init_process_group("gloo")
    dist.new_group([0, 1])  # registered on ranks 0 and 1 alone
    try:
        mesh3d.build_mesh(dp=4, timeout=60)
    except ValueError as error:
        return str(error)
    return "built"


def test_a_users_own_subset_group_is_refused_by_name_not_hung():
    """A plain new_group of some ranks before build_mesh leaves the ranks holding different numbers
    of groups, by which torch names the next ones: every rank raises the same error, naming the fix."""
    errors = run_on_ranks(_a_users_subset_group_first, 4, timeout=120)
    assert len(set(errors)) == 1 and "the ranks hold from 1 to 2 process groups" in errors[0], errors
    assert "layout.subgroup(members)" in errors[0]
