"""train.py between logging steps waits for no device (issue 65, torchtitan's rule): the loss,
the gradient norm, the skip of a non-finite step and the memory are read only on logging steps
(`--log-every`), the steps between hold them unread (mesh3d.train.UnreadSteps) and skip on the
device (mesh3d.train.DeviceStepGuard), and the JSONL still has every step's row.

train.py's main runs in-process on 4 ranks at (pp, dp, tp) = (2, 2, 1), each step's loop body
under tests/host_syncs.py's counter (from the profiler's start of the step to its end, so the
loader, the LR, the step, clipping, the optimizer's skip and the logging all count). The
reference: the logging steps do read (the counter sees them), the others read nothing.
"""

import json
import os

from multiprocess import run_on_ranks
from train_launch import ROOT

STEPS, LOG_EVERY = 7, 3
LOGGED = {1, 4, 7}  # steps counted from 1: every LOG_EVERY-th from the first, and the last


def _count_each_step(argv: list[str]) -> dict[int, list[str]]:
    os.chdir(ROOT)
    from host_syncs import HostSyncCounter

    from examples.llama import train

    per_step: dict[int, list[str]] = {}

    class CountingProfiler(train.StepProfiler):
        """The loop's own step hooks, each step's body counted between them."""

        def before(self, step: int) -> None:
            super().before(step)
            self.counter = HostSyncCounter().__enter__()

        def after(self, step: int) -> str | None:
            self.counter.__exit__(None, None, None)
            per_step[step] = self.counter.ops
            return super().after(step)

    train.StepProfiler = CountingProfiler
    train.main(argv)
    return per_step


def test_steps_between_logging_steps_read_nothing_back(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    argv = ["--pp", "2", "--dp", "2", "--steps", str(STEPS), "--log-every", str(LOG_EVERY), "--seq-len", "32"]
    argv += ["--global-batch", "8", "--warmup", "2", "--metrics", str(metrics)]
    for rank, per_step in enumerate(run_on_ranks(_count_each_step, 4, argv, timeout=300)):
        assert sorted(per_step) == list(range(1, STEPS + 1)), per_step
        for step, ops in per_step.items():
            if step in LOGGED:
                assert ops, f"rank {rank} step {step}: a logging step read nothing (the counter sees no read)"
            else:
                assert not ops, f"rank {rank} step {step} (not a logging step): {len(ops)} syncs: {ops}"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) for r in records), records
    assert all(r["skipped"] is False for r in records)
    assert {r["step"] for r in records if "memory_peak_gib" in r} == LOGGED  # the memory: logging steps only
