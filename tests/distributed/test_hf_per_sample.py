"""Hugging Face models given `position_ids` and `attention_mask` through `pm.step(inputs, targets,
**per_sample)` equal transformers' own model in one process given the same ones (its forward with
use_cache=False, as in training: with a cache, transformers does not read packed position ids).

One launch at (pp, dp, tp) = (2, 1, 2): Llama (llama3 rope scaling, GQA, tied) and Qwen2 (biases),
each with packed position ids (positions restarting per document: transformers attends within
each document) and with a left-padding attention mask (pads ignored targets, -100), two SGD steps:
every step's loss and every parameter after them (fp32, rel 1e-5). The inputs are real: the
reference without them gives another loss. An input no stage takes (`document_ids`) and a mask
of the wrong batch size are refused on every rank before any message, naming the input.
"""

from __future__ import annotations

import functools

import hf_cases
import pytest
import torch
from multiprocess import run_on_ranks
from rank_errors import assert_raised_on_every_rank, messages_of

pytest.importorskip("transformers")

BATCH, MICROBATCHES = 8, 4
RUNS = {  # (architecture, batches) -> schedule
    ("llama", "packed"): "1f1b",
    ("llama", "padded"): "interleaved_1f1b",
    ("qwen2", "packed"): "zbv",
    ("qwen2", "padded"): "gpipe",
}
BATCHES = {"packed": hf_cases.packed_batches, "padded": hf_cases.padded_batches}


def _on_rank() -> dict:
    import mesh3d

    layout = mesh3d.build_mesh(pp=2, dp=1, tp=2)
    out = {}
    for (arch, kind), schedule in RUNS.items():
        pm = mesh3d.parallelize(hf_cases.hf_model(arch), layout, schedule=schedule, microbatches=MICROBATCHES)
        out[(arch, kind)] = hf_cases.train_steps(pm, layout, BATCHES[kind](BATCH))
    inputs, targets, extra = hf_cases.padded_batches(BATCH)[0]
    out["refusals"] = messages_of(
        {
            "no stage takes it": lambda: pm.step(inputs, targets, document_ids=torch.zeros_like(inputs)),
            "batch size": lambda: pm.evaluate(inputs, targets, attention_mask=extra["attention_mask"][:6]),
        }
    )
    return out if layout.rank == 0 else {"refusals": out["refusals"]}


@functools.cache
def _launch() -> list[dict]:
    return run_on_ranks(_on_rank, 4, timeout=300)


@pytest.mark.parametrize("case", list(RUNS), ids="-".join)
def test_position_ids_and_attention_mask_equal_transformers(case):
    arch, kind = case
    data = BATCHES[kind](BATCH)
    reference = hf_cases.reference_run(arch, data)
    error, where = hf_cases.worst_error(_launch()[0][case], reference)
    assert error <= hf_cases.TOLERANCE, (case, where, error)
    without = hf_cases.reference_run(arch, [(inputs, targets) for inputs, targets, _ in data])
    assert abs(without[0][0] - reference[0][0]) > 1e-3 * abs(reference[0][0]), "the input changed nothing"


def test_an_input_no_stage_takes_and_a_wrong_batch_are_refused_on_every_rank():
    assert_raised_on_every_rank(
        [rank["refusals"] for rank in _launch()],
        {
            "no stage takes it": "per-sample input(s) ['document_ids'] were given, but no pipeline stage takes them "
            "(the stages take ['attention_mask', 'position_ids'])",
            "batch size": "per-sample input 'attention_mask' of shape (6, 8) holds 6 samples, the tokens of shape "
            "(8, 8) hold 8",
        },
    )
