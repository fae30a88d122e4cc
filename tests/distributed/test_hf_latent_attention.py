"""Multi-head latent attention (MLA: DeepSeek-V3, MiniCPM3, Sarvam-MLA; dense, tiny) through mesh3d
equals transformers' own model in one process: at (2,1,1) each under a schedule of its own, two SGD
steps with masked targets, every step's loss and every parameter (fp32, rel 1e-5). At (2,1,2),
DeepSeek-V3's plan shards its MLPs and leaves the latent attention replicated, and it is exact too;
MiniCPM3's splits the latent projection with the style "mla_kv_a_proj", which has no exact DTensor
equivalent: refused on every rank, naming it, before any message.
"""

from __future__ import annotations

import functools

import hf_cases
import pytest
from multiprocess import run_on_ranks
from rank_errors import assert_raised_on_every_rank, messages_of

pytest.importorskip("transformers")

BATCH, MICROBATCHES = 8, 4
RUNS = {
    (2, 1, 1): {"minicpm3": "1f1b", "deepseek_v3": "interleaved_1f1b", "sarvam_mla": "zero_bubble"},
    (2, 1, 2): {"deepseek_v3": "1f1b"},
}


def _on_rank(pp: int, dp: int, tp: int) -> dict:
    import mesh3d

    layout = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
    data = hf_cases.masked_batches(BATCH)
    out = {"runs": {}}
    for arch, schedule in RUNS[(pp, dp, tp)].items():
        out["runs"][arch] = hf_cases.pipeline_run(arch, layout, data, schedule=schedule, microbatches=MICROBATCHES)
    if tp > 1:
        out["refusals"] = messages_of(
            {"minicpm3": functools.partial(mesh3d.parallelize, hf_cases.meta_hf_model("minicpm3"), layout)}
        )
    return out if layout.rank == 0 else {k: out[k] for k in ("refusals",) if k in out}


@functools.cache
def _launch(layout: tuple[int, int, int]) -> list[dict]:
    pp, dp, tp = layout
    return run_on_ranks(_on_rank, pp * dp * tp, pp, dp, tp, timeout=300)


@pytest.mark.parametrize("layout", list(RUNS), ids=lambda layout: "pp{}dp{}tp{}".format(*layout))
def test_latent_attention_equals_transformers(layout):
    for arch, run in _launch(layout)[0]["runs"].items():
        error, where = hf_cases.worst_error(run, hf_cases.reference_run(arch, hf_cases.masked_batches(BATCH)))
        assert error <= hf_cases.TOLERANCE, (layout, arch, where, error)


def test_the_latent_projection_split_is_refused_under_tensor_parallelism():
    assert_raised_on_every_rank(
        [rank["refusals"] for rank in _launch((2, 1, 2))],
        {"minicpm3": "MiniCPM3ForCausalLM (minicpm3): its tensor-parallel plan gives module pattern"},
    )
