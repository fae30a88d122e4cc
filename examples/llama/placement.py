"""`--placement-report FILE`: where each rank runs, to check that tensor-parallel (and context-parallel)
groups stay within a node."""

from __future__ import annotations

import os

import torch

import mesh3d


def placement_report(layout: mesh3d.Layout) -> dict:
    """Every rank's node (torchrun's GROUP_RANK) and mesh coordinate, and whether each tp group (and,
    with --cp > 1, each cp group: its attention gathers K/V every layer) sits on one node."""
    mine = {"rank": layout.rank, "node": int(os.environ.get("GROUP_RANK", 0)), "coordinate": list(layout.coordinate)}
    everyone = [None] * layout.world_size
    torch.distributed.all_gather_object(everyone, mine)
    node_of = {r["rank"]: r["node"] for r in everyone}
    report: dict = {"ranks": everyone}
    for dim in ("tp", "cp") if layout.cp > 1 else ("tp",):
        groups = layout.axis_groups(dim)
        report[f"{dim}_groups"] = groups
        report[f"{dim}_groups_within_one_node"] = all(len({node_of[r] for r in group}) == 1 for group in groups)
    return report
