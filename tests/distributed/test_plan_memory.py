"""The planner's memory against what mesh3d really holds, one real step per layout.

For the LLaMA example's debug config (seq 64, global batch 8, fp32) at (1,1,2), (2,2,1) FSDP and
DDP, (2,1,2) and (2,2,2), interleaved 1F1B with microbatches = 2*pp (and tied embeddings at
(2,2,1) and at (4,1,1) 1F1B), in every activation-checkpoint mode (the first layout of 2 and 4
ranks in all four, the others in two each, every mode at several): mesh3d.plan (every choice pinned)
predicts each pipeline rank's parameter, gradient and AdamW bytes (Plan.memory_by_pp_rank: its
fullest dp and tp rank), which must equal the max over that
pipeline rank's ranks of the local shards exactly, and the bytes kept for backward, which must be
within ACTIVATION_TOLERANCE of the peak that
mesh3d.planner.measure.meters.SavedBytesMeter (the probe's own meter) sees on the ranks; under "selective",
whose forward graph is dropped, of the peak between actions of the meter's bytes plus the cached
results and stage inputs the interpreter holds (bench/parallel_step.py's kept_between_actions). Predictions are
made here, before the ranks start (the probe's fake process group needs a process without one);
the ranks measure with bench/parallel_step.py's own `measure`. One launch per world size.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from multiprocess import run_on_ranks  # noqa: E402
from parallel_step import Case, measure, predict, worst  # noqa: E402

pytestmark = pytest.mark.distributed

SEQ_LEN, BATCH = 64, 8
ACTIVATION_TOLERANCE = 0.10
AC_MODES = ["never", "always", "except_last"]
try:
    import mesh3d.pipeline.activation_checkpoint  # noqa: F401

    AC_MODES.append("selective")
except ImportError:
    pass

LAYOUTS = {
    2: [Case(1, 1, 2)],
    4: [
        Case(2, 2, 1),
        Case(2, 2, 1, "ddp"),
        Case(2, 1, 2),
        Case(2, 2, 1, tie_embeddings=True),
        Case(4, 1, 1, schedule="1f1b", tie_embeddings=True),
    ],
    8: [Case(2, 2, 2)],
}


def _modes(index: int, world: int) -> list[str]:
    """Every mode for a world's first layout up to 4 ranks; two for each other one (and for 8's,
    whose ranks cost twice: never and the last), in turn, so each mode meets several of them (a
    mode changes only the bytes kept for backward)."""
    if world == 8:
        return [AC_MODES[0], AC_MODES[-1]]
    if index == 0:
        return AC_MODES
    return [AC_MODES[index % len(AC_MODES)], AC_MODES[(index + 2) % len(AC_MODES)]]


def _cases(world: int) -> dict[str, Case]:
    return {
        f"{c.pp},{c.dp},{c.tp} {c.dp_mode}{' tied' if c.tie_embeddings else ''} ac={ac}": c._replace(
            activation_checkpoint=ac
        )
        for index, c in enumerate(LAYOUTS[world])
        for ac in _modes(index, world)
    }


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_predicted_memory_is_what_ranks_hold(world):
    cases = _cases(world)
    predicted = {name: predict(case, world, BATCH, SEQ_LEN) for name, case in cases.items()}
    per_rank = run_on_ranks(measure, world, cases, BATCH, SEQ_LEN, 0, timeout=300)
    failures = []
    print(f"\n{'case':<28} {'pp rank':>7} {'what':<12} {'measured':>10} {'predicted':>10}")
    for name, case in cases.items():
        assert len(predicted[name].memory_by_pp_rank) == case.pp
        for pp_rank, want in enumerate(predicted[name].memory_by_pp_rank):
            got = worst(per_rank, name, pp_rank)
            for what in ("parameters", "gradients", "optimizer", "activations"):
                m, p = getattr(got, what), getattr(want, what)
                print(f"{name:<28} {pp_rank:>7} {what:<12} {m:>10} {p:>10}")
                ok = abs(p - m) <= ACTIVATION_TOLERANCE * m if what == "activations" else p == m
                if not ok:
                    failures.append(f"{name} pp rank {pp_rank} {what}: measured {m}, predicted {p}")
    assert not failures, "\n".join(failures)
