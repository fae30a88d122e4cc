"""`--placement-report FILE`: where each rank runs, to check that tensor-parallel groups stay within a node."""

from __future__ import annotations

import os

import torch

import mesh3d


def placement_report(layout: mesh3d.Layout) -> dict:
    """Every rank's node (torchrun's GROUP_RANK) and mesh coordinate, and whether each tp group sits on one node."""
    mine = {"rank": layout.rank, "node": int(os.environ.get("GROUP_RANK", 0)), "coordinate": list(layout.coordinate)}
    everyone = [None] * layout.world_size
    torch.distributed.all_gather_object(everyone, mine)
    node_of = {r["rank"]: r["node"] for r in everyone}
    tp_groups = layout.axis_groups("tp")
    return {
        "ranks": everyone,
        "tp_groups": tp_groups,
        "tp_groups_within_one_node": all(len({node_of[r] for r in group}) == 1 for group in tp_groups),
    }
