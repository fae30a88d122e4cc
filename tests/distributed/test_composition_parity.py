"""pp x dp x tp training equals one process: losses, clipped grad norms and parameters after 2 AdamW steps.

Every (pp, dp, tp) whose product is 1, 2, 4 or 8, FSDP over dp, interleaved 1F1B (the default
schedule), tied and untied (at 8 ranks each layout once, tied and untied alternating); DDP on
every layout with dp > 1; 1F1B, GPipe, the zero-bubble schedules, DualPipeV, other microbatch
counts, activation checkpointing (selective too), reshard_after_forward=True, loss parallel and
the fused head and loss, stages of an end alone on a subset. Each data-parallel
rank steps on its share of the global batch; the reference is one process on the whole batch.
One process-group launch per world size (two for 8) runs all its cases.

58 cases; a vocabulary of 65 or 66 rows makes FSDP pad the tied weight. The model is a tiny LLaMA
whose split sizes all divide 8 (pipeline_cases.tp_args: dim 64, 16 heads, 8 kv heads, FFN 176,
vocabulary 64, sequence 8), with one block per stage the case's schedule makes (two where
activation checkpointing chooses among a stage's blocks; 8 stages at most). docs/parallelize.md's
table of supported layouts lists the cases.
"""

import pytest
from multiprocess import run_on_ranks
from pipeline_cases import TOLERANCE, VOCAB, batches, fewest_layers, pipeline_run, reference_run, tp_args, worst_error

import mesh3d
from examples.llama.model import llama_tp_plan

GLOBAL_BATCH = 16

LAYOUTS = {
    1: [(1, 1, 1)],
    2: [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
    4: [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)],
    8: [(8, 1, 1), (1, 8, 1), (1, 1, 8), (4, 2, 1), (4, 1, 2), (2, 4, 1), (1, 4, 2), (2, 1, 4), (1, 2, 4), (2, 2, 2)],
}

# (layout, tied, parallelize options) beyond FSDP + interleaved 1F1B. "vocab" changes the model:
# 65 rows (66 over tp = 2) do not shard evenly over dp, so FSDP pads the tied weight (both tie ends
# on one rank at pp=1).
EXTRA = {
    2: [((1, 2, 1), True, {"vocab": 65})],
    4: [
        ((1, 2, 2), True, {"vocab": 66}),
        ((1, 4, 1), True, {"vocab": 66, "dp_mode": "ddp"}),
        ((2, 2, 1), True, {"schedule": "1f1b"}),
        ((2, 1, 2), False, {"schedule": "gpipe", "microbatches": 4}),
        ((1, 2, 2), True, {"loss_parallel": True}),
        # W starts inside the graph, past FSDP's hooks: resharded parameters and loss parallel there.
        ((2, 2, 1), True, {"schedule": "zbv", "microbatches": 4, "reshard_after_forward": True}),
        ((2, 1, 2), False, {"schedule": "zero_bubble", "loss_parallel": True, "microbatches": 4}),
        # Selective checkpointing with TP's sequence-parallel plan, and with DDP under a split backward.
        ((2, 1, 2), True, {"activation_checkpoint": "selective"}),
        (
            (2, 2, 1),
            False,
            {"schedule": "zero_bubble", "dp_mode": "ddp", "microbatches": 4, "activation_checkpoint": "selective"},
        ),
        # The head fused with the default loss (loss_fn None): its one backward node split into I and
        # W under ZBV, with FSDP and both tie ends on rank 0; and recomputed under DDP.
        ((2, 2, 1), True, {"fused_loss": True, "loss_fn": None, "schedule": "zbv", "microbatches": 4}),
        ((2, 2, 1), False, {"fused_loss": True, "loss_fn": None, "dp_mode": "ddp", "activation_checkpoint": "always"}),
        # Stages of an end alone (the embedding, the head and loss) under FSDP, both tie ends on them.
        ((2, 2, 1), True, {"layers_per_stage": [0, 2, 2, 0]}),
    ],
    # At 8 ranks, what only 8 hold: every schedule family with all three axes at once (interleaved
    # 1F1B in the FSDP part; 1F1B, GPipe and selective checkpointing composed at 4 ranks already),
    # the deeper pipelines (pp = 4, 8) with dp or tp, and each option once.
    8: [
        ((8, 1, 1), True, {"schedule": "gpipe", "microbatches": 8}),
        ((2, 2, 2), False, {"loss_parallel": True, "microbatches": 4}),
        (
            (4, 2, 1),
            True,
            {"virtual_stages": 2, "microbatches": 2 * 4, "activation_checkpoint": "except_last", "dp_mode": "ddp"},
        ),
        # Zero-bubble schedules (split backward) composed with FSDP, DDP, TP, ties and recompute.
        ((2, 2, 2), True, {"schedule": "zero_bubble", "dp_mode": "ddp", "microbatches": 4}),
        ((4, 1, 2), False, {"schedule": "zero_bubble", "microbatches": 8, "activation_checkpoint": "always"}),
        ((2, 4, 1), True, {"schedule": "zbv", "dp_mode": "ddp"}),
        # ZBV with FSDP, TP and a tie, and selective checkpointing there (resharded: parameters gathered
        # again for the recompute).
        ((2, 2, 2), True, {"schedule": "zbv", "reshard_after_forward": True, "activation_checkpoint": "selective"}),
        # DualPipeV (deferred W's over both stages of the V) with FSDP, TP, a tie on rank 0 and recompute at I.
        ((2, 2, 2), True, {"schedule": "dualpipev", "microbatches": 4, "activation_checkpoint": "always"}),
    ],
}


def cases(world: int, part: str = "all") -> list[tuple]:
    # Tied and untied at every layout up to 4 ranks; at 8, each layout once, the tie alternating (the
    # tie's groups and FSDP's padding are already proven at every smaller world; this halves 8's launch).
    ties = ((False, True),) * len(LAYOUTS[world]) if world < 8 else [(i % 2 == 1,) for i in range(len(LAYOUTS[world]))]
    fsdp = [(layout, tied, {}) for layout, choices in zip(LAYOUTS[world], ties) for tied in choices]
    # DDP on every layout with dp > 1, under the default schedule where no extra case holds DDP there already.
    ddp_elsewhere = {layout for layout, _, options in EXTRA.get(world, []) if options.get("dp_mode") == "ddp"}
    with_dp = [layout for layout in LAYOUTS[world] if layout[1] > 1 and (world < 8 or layout not in ddp_elsewhere)]
    ddp = [(layout, i % 2 == 0, {"dp_mode": "ddp"}) for i, layout in enumerate(with_dp)]
    chosen = {"fsdp": fsdp, "other": ddp + EXTRA.get(world, []), "all": fsdp + ddp + EXTRA.get(world, [])}[part]
    return chosen


def describe(layout, tied, options) -> str:
    extra = " ".join(f"{k}={v}" for k, v in options.items())
    return f"(pp,dp,tp)={layout} tied={tied} {extra}".strip()


def _run_cases(world, part, references):
    layouts = {}
    outcome = {}
    for layout_sizes, tied, options in cases(world, part):
        if layout_sizes not in layouts:
            pp, dp, tp = layout_sizes
            layouts[layout_sizes] = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
        kwargs = dict(options)
        vocab = kwargs.pop("vocab", VOCAB)
        if kwargs.get("loss_parallel"):
            kwargs["tp_plan"] = llama_tp_plan(loss_parallel=True)
        args = tp_args(tied, _layers(layout_sizes, options)).with_(vocab_size=vocab)
        result = pipeline_run(layouts[layout_sizes], tied, batches(GLOBAL_BATCH), args=args, **kwargs)
        reference = references[_model(layout_sizes, tied, options)]
        outcome[describe(layout_sizes, tied, options)] = worst_error(result, reference)
    return outcome


def _layers(layout, options) -> int:
    """One block per stage (two where activation checkpointing chooses among a stage's blocks)."""
    per_stage = 2 if options.get("activation_checkpoint", "never") != "never" else 1
    return fewest_layers(layout[0], options, per_stage)


def _model(layout, tied, options) -> tuple[bool, int, int]:
    return tied, options.get("vocab", VOCAB), _layers(layout, options)


def _check(world, part):
    references = {
        (tied, vocab, layers): reference_run(tied, batches(GLOBAL_BATCH), tp_args(tied, layers).with_(vocab_size=vocab))
        for tied, vocab, layers in {_model(layout, tied, options) for layout, tied, options in cases(world, part)}
    }
    per_rank = run_on_ranks(_run_cases, world, world, part, references, timeout=600)
    failures = []
    for rank, outcome in enumerate(per_rank):
        assert len(outcome) == len(cases(world, part))
        for case, (error, where) in outcome.items():
            if error > TOLERANCE:
                failures.append(f"rank {rank} {case}: relative error {error:.2e} at {where}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_layout_matches_single_process(world):
    _check(world, "all")


def test_every_8_rank_layout_with_fsdp_matches_single_process():
    _check(8, "fsdp")


def test_8_rank_ddp_schedules_and_options_match_single_process():
    _check(8, "other")
