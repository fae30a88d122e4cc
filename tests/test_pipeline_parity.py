"""Pipelined training equals one process: losses, clipped grad norms and parameters after 3 AdamW steps.

For pp in {2, 4}: every schedule (interleaved with 2 stages per rank), microbatches pp, 2*pp and
pp+1, tied and untied, every activation-checkpoint mode. One process-group launch per pp runs all
its cases; the single-process references are computed once, here, and shipped to the ranks.
Each rank also checks its runtime's peak live activations against the simulator's.
"""

import itertools

import pytest

import mesh3d
from mesh3d.pipeline import simulate
from multiprocess import run_on_ranks
from pipeline_cases import TOLERANCE, batches, pipeline_run, reference_run, worst_error

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}  # name -> virtual stages
AC_MODES = ("never", "always", "except_last")
MICROBATCH_SIZE = 2


def cases(pp):
    counts = (pp, 2 * pp, pp + 1)
    return list(itertools.product(SCHEDULES, counts, (False, True), AC_MODES))


def _run_cases(pp, references):
    layout = mesh3d.build_mesh(pp=pp, dp=1, tp=1)
    outcome = {}
    for schedule, m, tied, ac in cases(pp):
        v = SCHEDULES[schedule]
        data = batches(MICROBATCH_SIZE * m)
        result = pipeline_run(layout, tied, data, schedule=schedule, microbatches=m, virtual_stages=v, activation_checkpoint=ac)
        error, where = worst_error(result, references[(tied, m)])
        pm = result[-1]
        simulated = simulate(schedule, pp, m, v).peak_activations[layout.pp_rank]
        recomputed = pm.runtime.counters.recomputed_forwards
        outcome[(schedule, m, tied, ac)] = (error, where, pm.peak_live_activations, simulated, recomputed)
    return outcome


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_matches_single_process(pp):
    references = {
        (tied, m): reference_run(tied, batches(MICROBATCH_SIZE * m))
        for tied in (False, True)
        for m in (pp, 2 * pp, pp + 1)
    }
    per_rank = run_on_ranks(_run_cases, pp, pp, references, timeout=300)
    failures = []
    for rank, outcome in enumerate(per_rank):
        assert len(outcome) == len(cases(pp))
        for (schedule, m, tied, ac), (error, where, peak, simulated, recomputed) in outcome.items():
            case = f"rank {rank} {schedule} m={m} tied={tied} ac={ac}"
            if error > TOLERANCE:
                failures.append(f"{case}: relative error {error:.2e} at {where}")
            if peak != simulated:
                failures.append(f"{case}: runtime peak live activations {peak}, simulator {simulated}")
            v = SCHEDULES[schedule]
            stage_forwards = v * m
            want_recomputed = {"never": 0, "always": stage_forwards, "except_last": stage_forwards - v}[ac]
            if recomputed != want_recomputed:
                failures.append(f"{case}: {recomputed} checkpointed forwards, expected {want_recomputed}")
    assert not failures, "\n".join(failures)
