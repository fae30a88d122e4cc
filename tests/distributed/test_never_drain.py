"""The never-drain schedules equal a one-process reference of their update rules.

For pipedream and pipedream_2bw at (4,1,1), (2,2,1) FSDP, (2,1,2) and (2,2,2), with SGD (momentum)
and AdamW, with a tied embedding and output head in half the cases: the loss every call returns and every weight after 6 calls and a
flush equal tests/never_drain_cases.py's reference (fp32, relative 1e-5), which applies the rules
with torch's own optimizer on the whole model. One launch per layout runs its cases.
"""

import pytest

import mesh3d
from multiprocess import run_on_ranks
from never_drain_cases import MICROBATCH_SIZE, call_batches, mesh3d_run, reference, worst

pytestmark = pytest.mark.distributed

LAYOUTS = {(4, 1, 1): 5, (2, 2, 1): 3, (2, 1, 2): 4, (2, 2, 2): 2}  # layout: microbatches per call
TOLERANCE = 1e-5


def cases(layout):
    m = LAYOUTS[layout]
    return [("pipedream_2bw", m, "sgd", True), ("pipedream_2bw", m, "adamw", False),
            ("pipedream", m, "sgd", False), ("pipedream", m, "adamw", True)]


def _run(pp, dp, tp):
    layout = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
    out = {}
    for schedule, m, optimizer, tied in cases((pp, dp, tp)):
        data = call_batches(MICROBATCH_SIZE * m * dp)
        losses, state, owners, pm = mesh3d_run(layout, schedule, m, tied, data, optimizer)
        kept = pm.runtime.versions.kept_bytes()
        out[(schedule, m, optimizer, tied)] = (losses, state if layout.rank == 0 else None, owners, kept)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda l: "x".join(map(str, l)))
def test_never_drain_matches_its_update_rule(layout):
    pp, dp, tp = layout
    per_rank = run_on_ranks(_run, pp * dp * tp, pp, dp, tp, timeout=300)
    failures = []
    for case in cases(layout):
        schedule, m, optimizer, tied = case
        losses, state, owners, _ = per_rank[0][case]
        for rank, outcome in enumerate(per_rank):
            if outcome[case][0] != losses:
                failures.append(f"{case}: rank {rank} returned losses {outcome[case][0]}, rank 0 {losses}")
        ref_losses, ref_state = reference(schedule, pp, m, dp, tied, call_batches(MICROBATCH_SIZE * m * dp),
                                          optimizer, owners)
        error, where = worst(losses, state, ref_losses, ref_state)
        if error > TOLERANCE:
            failures.append(f"{case}: relative error {error:.2e} at {where}")
    assert not failures, "\n".join(failures)
