"""Context parallelism divides a step's memory: one 4096-token sequence of the example LLaMA (dim 256,
4 layers, 8 heads, vocabulary 256) at cp = 4 against the same step at cp = 1, each in processes of
its own, measured by bench/long_context.py's own `measure` (the rise of ru_maxrss during the first
`pm.step` over ru_maxrss just before it, the high-water mark restarted at the resident size).

glibc's M_MMAP_THRESHOLD is fixed at 128 KiB in the ranks, so every tensor of 128 KiB or more is
a mapping of its own, returned when freed: the rise then follows the bytes of live tensors, and
repeats to the MiB (cp = 1: 394 MiB; cp = 4: 124 to 128 MiB per rank, 0.32x, on a 2-core machine,
torch 2.13; 0.34x while causal calls held mask rows). With glibc's own threshold the rise also
holds what the heap keeps of freed tensors, which varies run to run (0.49x to 0.61x here;
docs/performance.md#long-sequences-context-parallelism).

The bound, 0.40x, leaves 0.08 over the measured 0.32 for what may move with torch or the machine
(the first step's one-time allocations: FSDP's and gloo's buffers; the kernels' own scratch); what
breaks cp's memory fails it: K and V kept whole for backward (about +32 MiB a rank: 0.42x), a rank
computing more than its own tokens (0.5x and up). The losses and gradient norms of the two runs
agree too (the attention's row blocks: mesh3d/context_parallel/attention.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from long_context import run  # noqa: E402

pytestmark = pytest.mark.distributed

SEQ = 4096
MMAP_THRESHOLD = 128 * 1024
BOUND = 0.40
MIB = 2**20


def test_each_cp4_rank_rises_under_0_4x_of_one_rank():
    (alone,) = run(SEQ, 1, mmap_threshold=MMAP_THRESHOLD, timeout=90)
    ranks = run(SEQ, 4, mmap_threshold=MMAP_THRESHOLD, timeout=90)
    assert alone.exact and all(r.exact for r in ranks), "the high-water mark could not be restarted"
    rises = [round(r.rise / MIB) for r in ranks]
    assert max(r.rise for r in ranks) <= BOUND * alone.rise, (
        f"cp=4 rises {rises} MiB per rank, cp=1 {alone.rise / MIB:.0f} MiB: more than {BOUND}x"
    )
    for r in ranks:
        assert r.loss == pytest.approx(alone.loss, rel=1e-5)
        assert r.grad_norm == pytest.approx(alone.grad_norm, rel=1e-5)
