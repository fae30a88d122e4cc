"""Any rank of a large world runs under torch's fake process group (issue 66): build_mesh,
parallelize and two steps of ranks {0, N/2 + 3, N - 1}, each in a process of its own, at 1,024
ranks (pp, dp, tp) = (8, 16, 8), with cp and with ep, and at 16,384 ranks (16, 128, 8); and the
groups it creates grow with the mesh's axes and the pipeline's channel kinds, not with the world:
each rank makes its own group per kind, among its members alone (distributed/group_kinds.py).
"""

import pytest
from dry_run_cases import LAYOUTS, dry_rank, sampled_ranks
from multiprocess import run_on_ranks


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_sampled_ranks_set_up_and_step_under_the_fake_backend(layout_name):
    if "ep" in layout_name:
        pytest.importorskip("transformers")
    world, sizes = LAYOUTS[layout_name]
    reports = run_on_ranks(dry_rank, 3, layout_name, timeout=300)
    assert [r["rank"] for r in reports] == sampled_ranks(world)
    for report in reports:
        assert report["steps"] == 2 and report["local parameters"] > 0
        # Before issue 66: 2,112 world-wide creations at 1,024 ranks, 33,920 at 16,384. Now none,
        # torch's flatten of dp x cp included (its DeviceMesh groups made by kind too)
        assert report["world-wide creations"] == 0, report
        # one per mesh dim, the flattened dp x cp and expert-mesh dim, and the pipeline's channels
        # in rounds of disjoint ranks: two per direction for a chain of stages
        dims = 3 + 2 * (sizes.get("cp", 1) > 1) + 3 * (sizes.get("ep", 1) > 1)
        assert report["member-only creations"] == dims + 2 * 2, report
    if world == 16384:
        assert max(r["setup s"] for r in reports) < 60
