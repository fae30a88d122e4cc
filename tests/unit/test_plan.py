"""mesh3d.plan: the contract's attributes, `fix`, the ranking, and errors a user can act on.

The LLaMA example's debug config on meta (4 blocks, 128 wide): the probe measures it in well under
a second, so the whole search over 4 GPUs runs here. Memory against a real run is
tests/distributed/test_plan_memory.py; step time against published runs test_plan_published.py.
"""

import math

import pytest
import torch

import mesh3d
from examples.llama.config import get_config
from examples.llama.model import Transformer
from mesh3d.pipeline.config import ACTIVATION_CHECKPOINT_MODES
from mesh3d.pipeline.schedule.catalog import SCHEDULES, check_schedule_config
from mesh3d.planner.band import is_tight, rank_within_band
from mesh3d.planner.constants import CP_SEARCHED_FROM_SEQ_LEN, MEMORY_PREDICTION_BAND
from mesh3d.planner.hardware import HARDWARE

SIZES = dict(gpus=4, gpus_per_node=4, hardware="h100", seq_len=64, global_batch=8)


def debug_model(**changes):
    with torch.device("meta"):
        return Transformer(get_config("debug", max_seq_len=64, **changes))


@pytest.fixture(scope="module")
def plans():
    return mesh3d.plan(debug_model(), **SIZES)


def test_plans_are_ranked_fastest_first_within_the_band_and_runnable(plans):
    """Fastest first; a tiny model is nowhere near the device's memory, so the band changes nothing."""
    assert len(plans) > 10
    assert all(p.error_band == HARDWARE["h100"].band for p in plans)
    speeds = [p.tokens_per_second_per_gpu for p in plans]
    assert speeds == sorted(speeds, reverse=True)
    for p in plans:
        assert p.pp * p.dp * p.cp * p.tp == 4
        assert p.local_batch == 8 // p.dp and p.microbatch_size * p.microbatches == p.local_batch
        check_schedule_config(p.schedule, p.pp, p.microbatches, p.virtual_stages)  # parallelize would accept it
        assert p.activation_checkpoint in ACTIVATION_CHECKPOINT_MODES and p.dp_mode in ("fsdp", "ddp")
        assert math.isclose(p.tokens_per_second_per_gpu, 8 * 64 / p.step_seconds / 4)
        assert 0 < p.mfu < 1 and 0 <= p.bubble_fraction < 1


def test_within_the_band_a_plan_near_the_limit_yields_to_a_roomy_one(plans):
    """With a limit that leaves half the plans tight (band.py): within a tier the roomy ones first,
    fastest first, then the tight ones, the least memory first; across tiers the speed decides."""
    totals = sorted(p.memory_per_rank.total for p in plans)
    limit = totals[len(totals) // 2] / (1 - MEMORY_PREDICTION_BAND)
    band = 0.2
    ranked = rank_within_band(plans, band, limit)
    assert len(ranked) == len(plans) and {p.error_band for p in ranked} == {band}
    fastest = max(p.tokens_per_second_per_gpu for p in plans)
    tier = [p for p in ranked if p.tokens_per_second_per_gpu >= fastest * (1 - band)]
    assert ranked[: len(tier)] == tier  # the first tier leads
    roomy = [p for p in tier if not is_tight(p, limit)]
    tight = [p for p in tier if is_tight(p, limit)]
    assert tier == roomy + tight and roomy and tight
    assert [p.tokens_per_second_per_gpu for p in roomy] == sorted(
        (p.tokens_per_second_per_gpu for p in roomy), reverse=True
    )
    assert [p.memory_per_rank.total for p in tight] == sorted(p.memory_per_rank.total for p in tight)
    by_speed = [p.tokens_per_second_per_gpu for p in rank_within_band(plans, 0.0, limit)]
    assert by_speed[0] == fastest


def test_memory_breakdown_adds_up_and_fits(plans):
    limit = 80 * 2**30 * 0.9
    for p in plans:
        m = p.memory_per_rank
        held = m.parameters + m.gradients + m.optimizer
        transient = m.communication + m.optimizer_step + m.context_parallel
        assert m.total == held + m.activations + m.recompute + transient
        during_backward = m.activations + m.recompute + m.communication + m.context_parallel
        assert m.optimizer_step == max(0, m.parameters - during_backward)
        assert m.gradients == m.parameters and m.optimizer == 2 * m.parameters  # fp32 grads, AdamW's two moments
        assert 0 < m.total <= limit


def test_every_schedule_is_planned_within_its_own_microbatch_rule(plans):
    """The catalog's schedules all appear but the never-drain ones (not modelled yet; 4 blocks: a V
    of 2*pp stages fits at pp=2), each only with microbatches it takes: dualpipev with at least
    2*pp, walked like any F/I/W list."""
    planned = {p.schedule for p in plans}
    assert planned == {name for name, spec in SCHEDULES.items() if not spec.never_drains}, set(SCHEDULES) - planned
    dualpipev = [p for p in plans if p.schedule == "dualpipev"]
    assert all(p.microbatches >= 2 * p.pp and p.virtual_stages == 2 for p in dualpipev)
    assert all(0 < p.memory_per_rank.activations and 0 <= p.bubble_fraction < 1 for p in dualpipev)


def test_parallelize_kwargs_name_parallelize_arguments(plans):
    import inspect

    accepted = set(inspect.signature(mesh3d.parallelize).parameters)
    kwargs = plans[0].parallelize_kwargs()
    assert set(kwargs) <= accepted
    assert kwargs["schedule"] in SCHEDULES and kwargs["pp"] == plans[0].pp


def test_fix_pins_every_choice():
    fix = {
        "pp": 2,
        "dp": 1,
        "tp": 2,
        "schedule": "1f1b",
        "virtual_stages": 1,
        "microbatches": 4,
        "activation_checkpoint": "always",
        "dp_mode": "fsdp",
        "param_dtype": None,
        "compile": False,
    }
    plans = mesh3d.plan(debug_model(), fix=fix, **SIZES)
    assert len(plans) == 1
    assert {k: getattr(plans[0], k) for k in fix} == fix


def test_more_pipeline_stages_hold_fewer_parameters_per_rank():
    per_rank = {
        pp: mesh3d.plan(
            debug_model(),
            fix={
                "pp": pp,
                "tp": 1,
                "schedule": "gpipe" if pp > 1 else "1f1b",
                "microbatches": 4,
                "activation_checkpoint": "never",
            },
            **{**SIZES, "gpus": pp, "gpus_per_node": pp},
        )[0].memory_per_rank.parameters
        for pp in (1, 2, 4)
    }
    assert per_rank[1] > per_rank[2] > per_rank[4]


def test_checkpointing_keeps_less():
    def kept(mode):
        fix = {
            "pp": 2,
            "dp": 2,
            "tp": 1,
            "schedule": "1f1b",
            "microbatches": 4,
            "activation_checkpoint": mode,
            "dp_mode": "fsdp",
        }
        return mesh3d.plan(debug_model(), fix=fix, **SIZES)[0].memory_per_rank.activations

    assert kept("always") < kept("except_last") < kept("never")


def test_resharding_after_forward_at_pp_above_one_trades_memory_for_gathers():
    """FSDP at pp > 1 keeps each stage gathered all step by default; resharding after each forward
    holds two blocks and the stage's own parameters instead, and gathers again per microbatch."""
    fix = {"pp": 2, "dp": 2, "tp": 1, "schedule": "1f1b", "microbatches": 4, "dp_mode": "fsdp"}
    fix.update(activation_checkpoint="never", param_dtype=None, compile=False)
    kept, resharded = (
        mesh3d.plan(debug_model(), fix={**fix, "reshard_after_forward": r}, **SIZES)[0] for r in (False, True)
    )
    assert resharded.memory_per_rank.communication < kept.memory_per_rank.communication
    assert resharded.time.exposed_dp_seconds > kept.time.exposed_dp_seconds
    assert resharded.parallelize_kwargs()["reshard_after_forward"] is True
    assert {p.reshard_after_forward for p in mesh3d.plan(debug_model(), fix=fix, **SIZES)} == {False, True}
    ddp = mesh3d.plan(debug_model(), fix={**fix, "dp_mode": "ddp"}, **SIZES)
    assert {p.reshard_after_forward for p in ddp} == {None}
    assert "reshard_after_forward" not in ddp[0].parallelize_kwargs()


def test_context_parallel_is_searched_for_long_sequences_and_pinned_otherwise(plans):
    """Unpinned, cp is searched from CP_SEARCHED_FROM_SEQ_LEN tokens on: there cp divides the GPUs
    and cuts seq_len into 2 x cp chunks; the global batch divides over dp alone; the plan hands cp
    to parallelize. Shorter sequences plan cp = 1 unless cp is pinned."""
    assert {p.cp for p in plans} == {1}
    assert all("cp" not in p.parallelize_kwargs() and p.memory_per_rank.context_parallel == 0 for p in plans)
    pinned = mesh3d.plan(debug_model(), fix={"cp": 2, "pp": 1}, **SIZES)
    assert {p.cp for p in pinned} == {2} and pinned[0].parallelize_kwargs()["cp"] == 2
    seq = CP_SEARCHED_FROM_SEQ_LEN
    with torch.device("meta"):
        long_model = Transformer(get_config("debug", max_seq_len=seq))
    sizes = {**SIZES, "seq_len": seq, "global_batch": 2}
    fix = {"pp": 1, "tp": 1, "activation_checkpoint": "never", "dp_mode": "fsdp", "reshard_after_forward": True}
    long = mesh3d.plan(long_model, fix=fix, **sizes)
    cut = [p for p in long if p.cp > 1]
    assert {p.cp for p in cut} == {2, 4}
    for p in cut:
        assert p.local_batch == 2 // p.dp
        assert p.parallelize_kwargs()["cp"] == p.cp and f" cp={p.cp} " in p.row()
        assert p.memory_per_rank.context_parallel > 0 and p.time.cp_seconds > 0


def test_context_parallel_ranks_hold_a_cp_th_of_the_tokens_and_shard_over_dp_x_cp():
    """At one dp rank's batch, cp ranks each hold 1/cp of the tokens (activations, FLOPs) and FSDP
    shards the parameters over dp x cp; the K/V exchange and its whole-sequence buffers come on top.
    The model's FLOPs per token (MFU's) do not change: each token still attends over the whole sequence."""
    fix = {"pp": 1, "dp": 1, "tp": 1, "microbatches": 1, "activation_checkpoint": "never", "dp_mode": "fsdp"}
    by_cp = {
        cp: mesh3d.plan(debug_model(), fix={**fix, "cp": cp}, **{**SIZES, "gpus": cp, "gpus_per_node": cp})[0]
        for cp in (1, 2, 4)
    }
    for cp in (2, 4):
        plan, whole = by_cp[cp], by_cp[1]
        assert plan.memory_per_rank.activations == pytest.approx(whole.memory_per_rank.activations / cp, rel=0.1)
        assert plan.memory_per_rank.parameters == pytest.approx(whole.memory_per_rank.parameters / cp, rel=0.05)
        assert plan.mfu * plan.step_seconds * cp == pytest.approx(whole.mfu * whole.step_seconds, rel=1e-6)
        assert plan.time.cp_seconds > 0 and plan.memory_per_rank.context_parallel > 0
    # each rank receives (cp - 1) / cp of the sequence's K and V (a model this small spends more on it than it saves)
    assert by_cp[4].time.cp_seconds > by_cp[2].time.cp_seconds


def test_context_parallel_is_refused_by_name_where_mesh3d_cannot_cut_the_sequence():
    """Pinned, as parallelize refuses it: a measured machine (its parts timed on whole sequences),
    a sequence that does not cut into 2 x cp chunks. A model whose blocks never call SDPA is planned at cp = 1."""
    with pytest.raises(ValueError, match="seq_len into 2 x cp chunks"):
        mesh3d.plan(debug_model(), fix={"cp": 4}, **{**SIZES, "seq_len": 60})
    measured = mesh3d.Hardware(  # as "this-machine" is, without measuring this one
        "measured",
        peak_flops=1e11,
        memory_bytes=2**34,
        intra_node_bandwidth=1e9,
        inter_node_bandwidth=1e9,
        memory_bandwidth=1e10,
        achievable_fraction=1.0,
        times_the_model=True,
    )
    with pytest.raises(ValueError, match="a measured machine times"):
        mesh3d.plan(debug_model(), fix={"cp": 2}, **{**SIZES, "hardware": measured})
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, vocab_size=256
    )
    config._attn_implementation = "eager"
    assert {p.cp for p in mesh3d.plan(config, **SIZES, fix={"tp": 1, "pp": 1})} == {1}
    with pytest.raises(ValueError, match="never call torch.nn.functional.scaled_dot_product_attention"):
        mesh3d.plan(config, **SIZES, fix={"tp": 1, "cp": 2})


def test_a_custom_hardware_and_a_memory_limit_as_text(plans):
    slow = mesh3d.Hardware(
        "slow",
        peak_flops=1e12,
        memory_bytes=2**30,
        intra_node_bandwidth=1e9,
        inter_node_bandwidth=1e8,
        memory_bandwidth=1e10,
    )
    fast = plans[0]
    plans = mesh3d.plan(debug_model(), **{**SIZES, "hardware": slow}, memory_limit="512MiB")
    assert plans[0].tokens_per_second_per_gpu < fast.tokens_per_second_per_gpu
    assert all(p.memory_per_rank.total <= 512 * 2**20 for p in plans)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fix": {"pipeline": 2}}, "fix has unknown keys ['pipeline']"),
        ({"tie_band": 1.5}, "tie_band must be a fraction in [0, 1)"),
        ({"fix": {"schedule": "pipedream"}}, "choose one of"),
        ({"fix": {"activation_checkpoint": "sometimes"}}, "activation_checkpoint='sometimes'"),
        ({"fix": {"reshard_after_forward": "yes"}}, "reshard_after_forward='yes'; give True or False"),
        ({"gpus": 12, "gpus_per_node": 8}, "not a whole number of nodes of 8; use a multiple of 8 (e.g. 8 or 16)"),
        ({"seq_len": 128}, "seq_len=128 is longer than the model takes (64)"),
        ({"memory_limit": "1MiB"}, "the leanest needs"),
        ({"memory_limit": "lots"}, "memory_limit='lots'"),
        ({"hardware": "tpu"}, "unknown hardware 'tpu'"),
        ({"global_batch": 3, "fix": {"dp": 2}}, "global_batch must divide over dp"),
    ],
)
def test_errors_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=None) as error:
        mesh3d.plan(debug_model(), **{**SIZES, **kwargs})
    assert message in str(error.value)


def test_nothing_fits_names_how_many_gpus_would():
    with pytest.raises(ValueError) as error:
        mesh3d.plan(debug_model(), **SIZES, memory_limit="4MiB")
    text = str(error.value)
    assert "no layout fits in 0.0 GiB per GPU on 4 GPUs" in text and "x the GPUs (" in text


def test_a_model_not_on_meta_is_refused():
    model = Transformer(get_config("debug", max_seq_len=64))
    with pytest.raises(ValueError, match="on the meta device"):
        mesh3d.plan(model, **SIZES)


def test_a_preset_with_its_layout_pinned():
    transformers = pytest.importorskip("transformers")  # noqa: F841
    fix = {"pp": 1, "dp": 8, "tp": 1, "dp_mode": "fsdp", "microbatches": 1, "activation_checkpoint": "never"}
    best = mesh3d.plan("llama3-8b", gpus=8, seq_len=4096, global_batch=8, fix=fix, memory_limit="1TiB")[0]
    assert best.memory_per_rank.parameters == pytest.approx(8.03e9 * 4 / 8, rel=0.01)  # fp32, sharded over 8
    assert 0.2 < best.mfu < 0.6


def test_this_machine_is_measured_once_and_plans():
    from mesh3d.planner.measure.machine_bench import measure_this_machine

    machine = measure_this_machine()
    assert machine is measure_this_machine()  # measured once per process
    assert machine.achievable_fraction == 1.0 and machine.peak_flops > 1e8 and machine.intra_node_bandwidth > 1e6
    # dp and its mode pinned: the data-parallel overhead is timed once, not per dp and mode (test_plan_this_machine.py
    # checks the timings themselves)
    fix = {"tp": 1, "dp": 2, "dp_mode": "fsdp", "param_dtype": None}
    plans = mesh3d.plan(debug_model(), **{**SIZES, "hardware": "this-machine"}, fix=fix)
    assert plans and all(p.param_dtype is None for p in plans)


def test_tensor_parallelism_is_measured_beside_a_process_group():
    """Under torchrun after build_mesh the probe's fake group cannot be made here: it runs in a process of its own."""
    import torch.distributed as dist

    mesh3d.build_mesh(pp=1, dp=1, tp=1, device="cpu")
    try:
        fix = {"pp": 1, "tp": 2, "schedule": "1f1b", "microbatches": 2, "activation_checkpoint": "never"}
        beside = mesh3d.plan(debug_model(), fix=fix, **SIZES)
    finally:
        dist.destroy_process_group()
    alone = mesh3d.plan(debug_model(), fix=fix, **SIZES)
    assert [p.memory_per_rank for p in beside] == [p.memory_per_rank for p in alone]
    assert [p.step_seconds for p in beside] == [p.step_seconds for p in alone]


def test_hsdp_is_planned_where_dp_spans_nodes_sharded_within_one():
    """Two GPUs a node: dp = 4 at pp = tp = 1 spans two nodes, so HSDP shards over a node's 2 ranks
    and replicates across the nodes: twice FSDP-over-4's parameter bytes, an all-reduce between
    the nodes on top of the traffic within one, and parallelize's dp_shard in the plan."""
    fix = {"pp": 1, "tp": 1, "microbatches": 1, "activation_checkpoint": "never", "param_dtype": None}
    plans = mesh3d.plan(debug_model(), fix=fix, **{**SIZES, "gpus_per_node": 2})
    by_mode = {p.dp_mode: p for p in plans}
    assert set(by_mode) == {"fsdp", "hsdp", "ddp"}
    hsdp, fsdp = by_mode["hsdp"], by_mode["fsdp"]
    assert (
        hsdp.dp_shard == 2
        and hsdp.parallelize_kwargs()["dp_shard"] == 2
        and "dp_shard" not in fsdp.parallelize_kwargs()
    )
    assert " hsdp dp_shard=2 " in hsdp.row()
    assert hsdp.memory_per_rank.parameters == pytest.approx(2 * fsdp.memory_per_rank.parameters, rel=0.05)
    assert hsdp.time.exposed_dp_seconds != fsdp.time.exposed_dp_seconds
    within_a_node = mesh3d.plan(debug_model(), fix=fix, **SIZES)  # four GPUs a node: nothing to replicate
    assert "hsdp" not in {p.dp_mode for p in within_a_node}
    with pytest.raises(ValueError, match="choose 'fsdp', 'hsdp'"):
        mesh3d.plan(debug_model(), fix={"dp_mode": "zero3"}, **SIZES)


def test_a_pinned_dp_shard_plans_hsdp_groups_of_that_size_whatever_the_node():
    """fix={"dp_mode": "hsdp", "dp_shard": 2} (a run's own groups, as the dry run pins them):
    planned within one node of four, as parallelize runs it; refused by name without HSDP."""
    fix = {"pp": 1, "tp": 1, "microbatches": 1, "activation_checkpoint": "never", "param_dtype": None}
    (hsdp,) = mesh3d.plan(
        debug_model(), fix={**fix, "dp_mode": "hsdp", "dp_shard": 2, "reshard_after_forward": True}, **SIZES
    )
    assert hsdp.dp_shard == 2 and hsdp.parallelize_kwargs()["dp_shard"] == 2
    with pytest.raises(ValueError, match="dp_shard sizes HSDP's sharding groups: pin it with dp_mode='hsdp'"):
        mesh3d.plan(debug_model(), fix={**fix, "dp_shard": 2}, **SIZES)
    with pytest.raises(ValueError, match="dp_shard into dp"):
        mesh3d.plan(debug_model(), fix={**fix, "dp_mode": "hsdp", "dp_shard": 3}, **SIZES)


def test_the_fused_head_and_loss_is_planned_when_pinned():
    """fix={"fused_loss": True} (parallelize's keyword, never searched): the last stage keeps no
    logits (a microbatch's, in the compute dtype, less), its backward runs the head's forward again
    (the step is longer by those FLOPs, which MFU does not count), only tp = 1 is planned, and the
    plan hands the keyword on; refused as parallelize refuses it."""
    fix = dict(
        pp=2, dp=2, schedule="1f1b", virtual_stages=1, microbatches=2, activation_checkpoint="never", dp_mode="ddp"
    )
    plain, fused = (mesh3d.plan(debug_model(), **SIZES, fix={**fix, "fused_loss": f}) for f in (False, True))
    assert len(plain) == len(fused) == 1 and fused[0].parallelize_kwargs()["fused_loss"] is True
    plain, fused = plain[0], fused[0]
    vocab, tokens = get_config("debug").vocab_size, fused.microbatch_size * SIZES["seq_len"]
    saved = plain.memory_by_pp_rank[-1].total - fused.memory_by_pp_rank[-1].total  # the last stage's rank
    assert saved >= tokens * vocab * 2  # a microbatch's bf16 logits at least
    head_flops = 2 * tokens * vocab * get_config("debug").dim
    extra = fused.time.backward_seconds[-1] - plain.time.backward_seconds[-1]
    rate = HARDWARE["h100"].peak_flops * HARDWARE["h100"].achievable_fraction
    assert extra == pytest.approx(head_flops / rate, rel=0.01)
    assert fused.mfu * fused.step_seconds == pytest.approx(plain.mfu * plain.step_seconds, rel=1e-6)
    assert all(p.tp == 1 for p in mesh3d.plan(debug_model(), **SIZES, fix={"fused_loss": True}))
    with pytest.raises(ValueError, match="tp=2 shards the head"):
        mesh3d.plan(debug_model(), **SIZES, fix={"fused_loss": True, "tp": 2})
    with pytest.raises(ValueError, match="fix fused_loss='yes'"):
        mesh3d.plan(debug_model(), **SIZES, fix={"fused_loss": "yes"})


def test_layers_per_stage_names_the_stages_and_reaches_parallelize():
    """Stages of an end alone (the first and the last at 0 blocks) planned as parallelize runs them:
    only layouts of that many stages, the counts handed on; bad counts refused before the search."""
    counts = [0, 4, 4, 0]
    fix = {"tp": 1, "dp": 1, "schedule": "interleaved_1f1b", "activation_checkpoint": "never", "param_dtype": None}
    plans = mesh3d.plan(debug_model(), **{**SIZES, "gpus": 2, "gpus_per_node": 2}, fix=fix, layers_per_stage=counts)
    assert plans and all(p.pp * p.virtual_stages == 4 for p in plans)
    assert plans[0].parallelize_kwargs()["layers_per_stage"] == counts
    # more stages than blocks, pp and v unpinned: the split decides v for each pp (8 stages of 6 blocks)
    fix = {key: fix[key] for key in ("tp", "activation_checkpoint", "param_dtype")}
    counts = [0, 1, 1, 1, 1, 1, 1, 0]
    plans = mesh3d.plan(debug_model(n_layers=6), **SIZES, fix=fix, layers_per_stage=counts)
    assert {(p.pp, p.virtual_stages) for p in plans} >= {(2, 4), (4, 2)}
    with pytest.raises(
        ValueError, match=r"layers_per_stage=\[0, 0, 8, 0\] must list 4 counts .* the first and the last"
    ):
        mesh3d.plan(debug_model(), **SIZES, layers_per_stage=[0, 0, 8, 0])
    with pytest.raises(ValueError, match="give split_points or layers_per_stage, not both"):
        mesh3d.plan(debug_model(), **SIZES, split_points=["layers.4"], layers_per_stage=[4, 4])
