"""The planner on a machine it measures (hardware="this-machine"): timed parts, collective latency,
communication that does not overlap, DTensor's cost in the optimizer.

The collective counts are what a real 2-rank run issues, counted with torch.profiler on
bench/plan_check.py's model (8 blocks, 4 microbatches): FSDP at (1,2,1) 72 all-gathers and 9
reduce-scatters, tensor parallelism at (1,1,2) 276 collectives = 4 x (8 per block x 8 + 5 for the
ends). The LLaMA debug config has 8 blocks too.
"""

import time

import pytest
import torch

import mesh3d
from examples.llama.config import get_config
from examples.llama.model import Transformer
from mesh3d.model.intake import anatomy_of
from mesh3d.model.loss import cross_entropy_loss
from mesh3d.planner.measure.part_timing import time_model
from mesh3d.planner.measure.probe import measure_model

SEQ = 64
BLOCKS = 8
LATENCY = 1e-3


def debug_model():
    with torch.device("meta"):
        return Transformer(get_config("debug", max_seq_len=SEQ))


def latency_only(**changes):
    """A machine whose links and memory are so fast that only the latency of each collective shows."""
    fields = dict(
        peak_flops=1e12,
        memory_bytes=2**40,
        intra_node_bandwidth=1e18,
        inter_node_bandwidth=1e18,
        memory_bandwidth=1e18,
        collective_latency=LATENCY,
        overlaps_communication=False,
    )
    return mesh3d.Hardware("latency-only", **{**fields, **changes})


def one_plan(hardware, **fix):
    fix = {"microbatches": 4, "activation_checkpoint": "never", "param_dtype": None, "compile": False, **fix}
    return mesh3d.plan(
        debug_model(),
        gpus=2,
        gpus_per_node=2,
        hardware=hardware,
        seq_len=SEQ,
        global_batch=8,
        fix=fix,
        memory_limit="1TiB",
    )[0]


def test_fsdp_without_pipeline_gathers_every_microbatch_and_reduces_once():
    # (blocks + the stage's root) x (a gather per microbatch forward and backward, one reduce-scatter)
    fsdp = one_plan(latency_only(), pp=1, dp=2, tp=1, dp_mode="fsdp")
    assert fsdp.time.exposed_dp_seconds == pytest.approx((BLOCKS + 1) * (2 * 4 + 1) * LATENCY, rel=1e-6)
    ddp = one_plan(latency_only(), pp=1, dp=2, tp=1, dp_mode="ddp")  # one all-reduce per module
    assert ddp.time.exposed_dp_seconds == pytest.approx((BLOCKS + 1) * LATENCY, rel=1e-6)


def flat_collectives(all_gather, reduce_scatter, all_reduce):
    """A CollectiveTimes whose every size takes the same seconds: each collective's count shows."""
    flat = lambda seconds: ((1.0, seconds), (2.0**40, seconds))  # noqa: E731
    return mesh3d.planner.CollectiveTimes(
        {"all_gather": flat(all_gather), "reduce_scatter": flat(reduce_scatter), "all_reduce": flat(all_reduce)}
    )


def test_measured_collectives_are_counted_per_module_at_their_own_time():
    machine = latency_only(collective_times=flat_collectives(1e-3, 5e-3, 7e-3))
    fsdp = one_plan(machine, pp=1, dp=2, tp=1, dp_mode="fsdp")  # each module: 2 x 4 gathers, 1 reduce-scatter
    assert fsdp.time.exposed_dp_seconds == pytest.approx((BLOCKS + 1) * (8 * 1e-3 + 5e-3), rel=1e-6)
    ddp = one_plan(machine, pp=1, dp=2, tp=1, dp_mode="ddp")  # each module: one all-reduce
    assert ddp.time.exposed_dp_seconds == pytest.approx((BLOCKS + 1) * 7e-3, rel=1e-6)


def linear_collectives():
    """A CollectiveTimes whose every collective takes one second per byte a rank sends."""
    line = ((1.0, 1.0), (2.0**40, 2.0**40))
    return mesh3d.planner.CollectiveTimes({kind: line for kind in ("all_gather", "reduce_scatter", "all_reduce")})


def test_measured_data_parallel_collectives_are_charged_the_bytes_a_rank_sends():
    elements = sum(p.numel() for p in Transformer(get_config("debug", max_seq_len=SEQ)).parameters())
    machine = latency_only(collective_times=linear_collectives())
    # FSDP over 2 ranks: each gather sends half the fp32 parameters, 4 microbatches x 2; the
    # reduce-scatter half the gradients
    fsdp = one_plan(machine, pp=1, dp=2, tp=1, dp_mode="fsdp")
    assert fsdp.time.exposed_dp_seconds == pytest.approx(8 * elements * 4 / 2 + elements * 4 / 2, rel=1e-6)
    ddp = one_plan(machine, pp=1, dp=2, tp=1, dp_mode="ddp")  # the ring all-reduce sends the gradients once
    assert ddp.time.exposed_dp_seconds == pytest.approx(elements * 4, rel=1e-6)


def test_measured_tensor_parallel_collectives_are_charged_by_kind():
    model = debug_model()
    costs = measure_model(
        model, anatomy_of(model), tp=2, tp_plan=model.tp_plan, microbatch_size=1, seq_len=SEQ, param_dtype=None
    )
    parts = [costs.block] * BLOCKS + [costs.first_end, costs.last_end]
    assert sum(count for _, count in costs.block.tp_by_kind.values()) == costs.block.tp_collectives == 8
    mbs = 2  # batch 8 over 4 microbatches
    # one second per byte: every byte the probe counted, whatever its kind, at the microbatch's size
    linear = one_plan(latency_only(collective_times=linear_collectives()), pp=1, dp=1, tp=2)
    assert linear.time.tp_seconds == pytest.approx(sum(p.tp_bytes for p in parts) * mbs, rel=1e-6)
    # a fixed time per kind: each kind's count at its own time
    times = {"all_gather": 1e-3, "reduce_scatter": 5e-3, "all_reduce": 7e-3}
    kinds = one_plan(latency_only(collective_times=flat_collectives(*times.values())), pp=1, dp=1, tp=2)
    want = sum(count * times[kind] for p in parts for kind, (_, count) in p.tp_by_kind.items())
    assert kinds.time.tp_seconds == pytest.approx(want, rel=1e-6)


def test_collective_times_interpolate_between_measured_sizes():
    times = mesh3d.planner.CollectiveTimes(
        {kind: ((100.0, 1.0), (300.0, 2.0), (500.0, 4.0)) for kind in ("all_gather", "reduce_scatter", "all_reduce")}
    )
    assert times.seconds("all_gather", 10.0) == 1.0  # below the smallest: its fixed cost
    assert times.seconds("reduce_scatter", 200.0) == pytest.approx(1.5)
    assert times.seconds("all_reduce", 1000.0) == pytest.approx(8.0)  # beyond: the largest's seconds per byte
    # over 4 ranks a ring takes 3 steps, each a third of what a rank sends
    assert times.seconds("all_gather", 600.0, ranks=4) == pytest.approx(3 * 1.5)
    # a larger size measured faster (noise) is taken as the smaller's time
    noisy = mesh3d.planner.CollectiveTimes(
        {kind: ((100.0, 2.0), (300.0, 1.0), (500.0, 4.0)) for kind in ("all_gather", "reduce_scatter", "all_reduce")}
    )
    assert noisy.seconds("all_gather", 300.0) == 2.0 and noisy.seconds("all_gather", 400.0) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="'all_reduce' needs at least two sizes in increasing order"):
        mesh3d.planner.CollectiveTimes(
            {
                "all_gather": ((1.0, 1.0), (2.0, 1.0)),
                "reduce_scatter": ((1.0, 1.0), (2.0, 1.0)),
                "all_reduce": ((1.0, 1.0),),
            }
        )


def test_communication_that_overlaps_hides_behind_compute():
    hidden = one_plan(latency_only(overlaps_communication=True), pp=1, dp=2, tp=1, dp_mode="fsdp")
    exposed = one_plan(latency_only(), pp=1, dp=2, tp=1, dp_mode="fsdp")
    assert hidden.time.exposed_dp_seconds < exposed.time.exposed_dp_seconds


def test_tensor_parallel_collectives_and_pipeline_messages_cost_their_latency():
    tp = one_plan(latency_only(), pp=1, dp=1, tp=2)
    assert tp.time.tp_seconds == pytest.approx((8 * BLOCKS + 5) * LATENCY, rel=1e-6)  # per microbatch
    pp = one_plan(latency_only(), pp=2, dp=1, tp=1, schedule="gpipe")
    assert pp.time.p2p_seconds == pytest.approx(LATENCY, rel=1e-6)


def test_dtensor_parameters_pay_the_update_overhead():
    slow_update = latency_only(collective_latency=0.0, dtensor_update_overhead=1e-3)
    plain = one_plan(slow_update, pp=2, dp=1, tp=1, schedule="gpipe")
    sharded = one_plan(slow_update, pp=1, dp=2, tp=1, dp_mode="fsdp")
    tensors = len(list(Transformer(get_config("debug", max_seq_len=SEQ)).parameters()))
    assert sharded.time.optimizer_seconds - plain.time.optimizer_seconds == pytest.approx(tensors * 1e-3, rel=1e-3)


def _best_seconds(fn, repeats=5):
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def test_timed_parts_add_up_to_the_whole_model_run_here():
    """The reference: the whole model, materialized, one forward and backward on one thread."""
    model, batch = debug_model(), 2
    anatomy = anatomy_of(model)
    costs = measure_model(model, anatomy, tp=1, tp_plan=None, microbatch_size=1, seq_len=SEQ, param_dtype=None)
    timed = time_model(model, anatomy, costs, tp_plan=None, microbatch_size=batch, param_dtype=None)
    parts = [timed.block] * BLOCKS + [timed.first_end, timed.last_end]
    predicted = sum(p.forward_seconds + p.backward_seconds for p in parts)

    torch.manual_seed(0)
    whole = Transformer(get_config("debug", max_seq_len=SEQ))
    tokens = torch.randint(0, 2, (batch, SEQ))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def step():
            loss = cross_entropy_loss(whole(tokens), tokens)
            (loss[0] if isinstance(loss, tuple) else loss).backward()

        measured = _best_seconds(step)
    finally:
        torch.set_num_threads(threads)
    assert timed.block.forward_seconds > 0 and timed.block.backward_seconds > 0
    # the split backward of zero-bubble schedules: I + W, of which W is a part
    assert timed.block.split_backward_seconds > timed.block.weight_half_seconds > 0
    assert 0.5 < predicted / measured < 2.0, (predicted, measured)  # a timing on a shared machine


def test_a_negative_latency_is_refused():
    with pytest.raises(ValueError, match="collective_latency must be seconds >= 0, got -1"):
        latency_only(collective_latency=-1)
