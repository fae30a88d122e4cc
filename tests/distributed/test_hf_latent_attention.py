"""Multi-head latent attention (MLA: DeepSeek-V3, MiniCPM3, Sarvam-MLA; dense, tiny) through mesh3d
equals transformers' own model in one process: at (2,1,1) each under a schedule of its own, two SGD
steps with masked targets, every step's loss and every parameter (fp32, rel 1e-5). At (2,1,2),
DeepSeek-V3's plan shards its MLPs and leaves the latent attention replicated, and it is exact too;
MiniCPM3's splits the heads of the latent attention, its shared key projection under the style
"mla_kv_a_proj" (the rotary part's gradient summed over tp: tensor/local_styles.py), and it is
exact as well. (DeepSeek-V3 with experts under tp: test_hf_experts.py.)
"""

from __future__ import annotations

import functools

import hf_cases
import pytest
from multiprocess import run_on_ranks

pytest.importorskip("transformers")

BATCH, MICROBATCHES = 8, 4
RUNS = {
    (2, 1, 1): {"minicpm3": "1f1b", "deepseek_v3": "interleaved_1f1b", "sarvam_mla": "zero_bubble"},
    (2, 1, 2): {"deepseek_v3": "1f1b", "minicpm3": "interleaved_1f1b"},
}


def _on_rank(pp: int, dp: int, tp: int) -> dict:
    import mesh3d

    layout = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
    data = hf_cases.masked_batches(BATCH)
    out = {"runs": {}}
    for arch, schedule in RUNS[(pp, dp, tp)].items():
        out["runs"][arch] = hf_cases.pipeline_run(arch, layout, data, schedule=schedule, microbatches=MICROBATCHES)
    return out if layout.rank == 0 else {}


@functools.cache
def _launch(layout: tuple[int, int, int]) -> list[dict]:
    pp, dp, tp = layout
    return run_on_ranks(_on_rank, pp * dp * tp, pp, dp, tp, timeout=300)


@pytest.mark.parametrize("layout", list(RUNS), ids=lambda layout: "pp{}dp{}tp{}".format(*layout))
def test_latent_attention_equals_transformers(layout):
    for arch, run in _launch(layout)[0]["runs"].items():
        error, where = hf_cases.worst_error(run, hf_cases.reference_run(arch, hf_cases.masked_batches(BATCH)))
        assert error <= hf_cases.TOLERANCE, (layout, arch, where, error)
