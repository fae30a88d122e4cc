"""A dry run is the real run (issue 66): at 8 ranks, (pp, dp, tp) = (2, 2, 2), the ranks a dry run
plays under torch's fake process group report what the same ranks of a real gloo run report: the
groups created and held, the bytes of parameters, gradients and optimizer state, and every
collective and message of the steps by group kind, call for call and byte for byte. Only the
object exchanges of the agreements differ: a dry run answers them alone (dry_world.py).
"""

import dataclasses
import functools
import time

import nccl_rules
from dry_run_cases import SEQ_LEN, model
from multiprocess import run_on_ranks

import mesh3d
from mesh3d.planner.fake_cluster import Job, measure_rank

SIZES = dict(pp=2, dp=2, tp=2)
PLAYED = [0, 3, 7]


def _job() -> Job:
    sizes = dict(SIZES, cp=1, ep=1)
    return Job(functools.partial(model, False, 4), 8, sizes, SEQ_LEN, 8, 2, False, {})


def _real_rank(job: Job):
    from mesh3d.distributed.creation_count import counting_group_creations

    with counting_group_creations() as creations:
        return measure_rank(job, creations, time.perf_counter())


def _without_agreements(report):
    """The report less the agreements' object exchanges (an all-gather of pickled objects over the
    world, which a dry run answers alone) and its timing."""
    traffic = {kind: dict(ops) for kind, ops in report.traffic.items()}
    traffic.get("default_pg", {}).pop("allgather_", None)
    return dataclasses.replace(report, traffic=traffic, setup_seconds=0.0)


def test_a_dry_run_reports_what_the_real_run_does_at_eight_ranks():
    # plain gloo: under NCCL's rules (nccl_rules.py) messages go out from a worker thread of each
    # communicator, where the traffic counter's dispatch mode (this thread's) does not see them
    real = run_on_ranks(_real_rank, 8, _job(), timeout=300, env={nccl_rules.ENV: "0"})
    dry = mesh3d.dry_run(
        functools.partial(model, False, 4), 8, PLAYED, **SIZES, seq_len=SEQ_LEN, global_batch=8, predict=False
    )
    assert [r.rank for r in dry] == PLAYED
    for report in dry:
        assert _without_agreements(report) == _without_agreements(real[report.rank])
        assert report.parameter_bytes > 0 and report.optimizer_bytes == 2 * report.parameter_bytes
