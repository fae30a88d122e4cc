"""Hugging Face causal LMs under context parallelism: transformers' Llama and Qwen3 as they are,
each sequence cut over cp ranks, equal to transformers' own model in one process on the whole
batch (use_cache=False; fp32, rel 1e-5: every step's loss and every parameter after two SGD steps).

One launch of 4 ranks, `mesh3d.build_mesh(pp=..., dp=..., cp=..., tp=...)` called exactly so:
Llama with packed position ids (documents read from the whole rows, never from a chunk) at
(pp, dp, cp, tp) = (2, 1, 2, 1) under ZBV, Qwen3 packed at (1, 1, 2, 2) (tensor parallel), Llama
without position ids at (1, 2, 2, 1) (FSDP over dp x cp). A padding mask and a sliding-window
architecture are refused on every rank, by name.
"""

from __future__ import annotations

import functools

import hf_cases
import pytest
from multiprocess import run_on_ranks
from rank_errors import assert_raised_on_every_rank, messages_of

pytest.importorskip("transformers")

BATCH = 4
RUNS = {  # (architecture, batches): ((pp, dp, cp, tp), schedule)
    ("llama", "packed"): ((2, 1, 2, 1), "zbv"),
    ("qwen3", "packed"): ((1, 1, 2, 2), "1f1b"),
    ("llama", "plain"): ((1, 2, 2, 1), "1f1b"),
}
BATCHES = {
    "packed": hf_cases.packed_batches,
    "padded": hf_cases.padded_batches,
    "plain": lambda batch: [(inputs, targets, {}) for inputs, targets in hf_cases.masked_batches(batch)],
}


def _on_rank() -> dict:
    import mesh3d

    out = {}
    for (arch, kind), ((pp, dp, cp, tp), schedule) in RUNS.items():
        layout = mesh3d.build_mesh(pp=pp, dp=dp, cp=cp, tp=tp)
        pm = mesh3d.parallelize(hf_cases.hf_model(arch), layout, schedule=schedule, microbatches=2)
        out[(arch, kind)] = hf_cases.train_steps(pm, layout, BATCHES[kind](BATCH))
    inputs, targets, extra = hf_cases.padded_batches(BATCH)[0]
    window = hf_cases.hf_model("mistral", sliding_window=4) if "mistral" in hf_cases.ARCHITECTURES else None
    out["refusals"] = messages_of(
        {
            "padding": lambda: pm.step(inputs, targets, attention_mask=extra["attention_mask"]),
            "sliding window": lambda: mesh3d.parallelize(window, layout, schedule="1f1b"),
        }
    )
    return out if layout.rank == 0 else {"refusals": out["refusals"]}


@functools.cache
def _launch() -> list[dict]:
    return run_on_ranks(_on_rank, 4, timeout=300)


@pytest.mark.parametrize("case", list(RUNS), ids="-".join)
def test_cp_equals_transformers(case):
    arch, kind = case
    reference = hf_cases.reference_run(arch, BATCHES[kind](BATCH))
    error, where = hf_cases.worst_error(_launch()[0][case], reference)
    assert error <= hf_cases.TOLERANCE, (case, where, error)


def test_padding_and_sliding_windows_are_refused_on_every_rank():
    assert_raised_on_every_rank(
        [rank["refusals"] for rank in _launch()],
        {
            "padding": "context parallelism (cp=2) does not take a 'attention_mask' (padding) yet",
            "sliding window": "its attention is a sliding window of 4 tokens",
        },
    )
