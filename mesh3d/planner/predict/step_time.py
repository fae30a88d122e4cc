"""Seconds per step at one layout: the schedule's own timeline with measured costs put in.

Per stage and microbatch, a forward costs its FLOPs at the achievable rate, the bytes an attention
that writes its score matrix out moves through it at the achievable memory bandwidth (0 under a
fused kernel), and its tensor-parallel collectives (not hidden: mesh3d runs them synchronously); a
backward costs its FLOPs, its score bytes, its collectives and its recomputation. Under context
parallelism the FLOPs are one cp rank's (measured on its tokens, the attention's second forward in
backward included) and each attention call adds its K/V all-gather to the forward (and to a
recompute), and a second all-gather and the fp32 reduce-scatter of dK/dV to the backward, over the
cp group's links, none hidden (the attention waits for them). Under expert parallelism each block's
forward adds its all-to-alls of routed rows (the dispatch and the combine) and of their counts, its
backward the two of rows again, over the ep group's link, none hidden (measure/experts.py). The
simulator (pipeline/schedule/timeline.py) plays the schedule's real action lists with each stage's
own costs and the P2P time of a boundary message, so the bubble is the schedule's, not a closed
form. FSDP/DDP traffic overlaps the compute (what exceeds it shows), and the optimizer's update is
memory-bound.

A machine the planner measured ("this-machine": hardware.py's `times_the_model`) gives the seconds
its parts were timed at (measure/part_timing.py) instead of FLOPs over a rate, each tensor- and
data-parallel collective at the time its kind was measured at its size (hardware.CollectiveTimes),
a latency for every pipeline message, and communication that does not overlap the compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mesh3d.pipeline.schedule.simulate import simulate_schedule
from mesh3d.planner import constants as C
from mesh3d.planner.hardware import Hardware
from mesh3d.planner.measure.costs import ModelCosts
from mesh3d.planner.measure.data_parallel_timing import DataParallelOverhead
from mesh3d.planner.predict.links import Links
from mesh3d.planner.predict.memory import StagePlacement, _stage_parts, rank_parameter_elements


@dataclass(frozen=True)
class StepTime:
    seconds: float
    bubble_fraction: float
    compute_seconds: float  # the pipeline's makespan
    exposed_dp_seconds: float
    optimizer_seconds: float
    tp_seconds: float  # tensor-parallel collectives of the heaviest stage's microbatch
    p2p_seconds: float  # one boundary message
    # The costs per stage the timeline was played with, so the timeline can be replayed (drawn)
    # for one plan without keeping every candidate's events.
    forward_seconds: tuple[float, ...] = ()
    backward_seconds: tuple[float, ...] = ()  # the whole backward, recomputation included
    weight_grad_seconds: tuple[float, ...] = ()  # the W part of a split backward (zero-bubble schedules)
    cp_seconds: float = 0.0  # context parallelism's K/V exchange of the heaviest stage's microbatch
    ep_seconds: float = 0.0  # expert parallelism's all-to-alls of the heaviest stage's microbatch


def step_time(
    costs: ModelCosts,
    place: StagePlacement,
    hardware: Hardware,
    links: Links,
    *,
    compile: bool,
    fp32_compute: bool,
    dp_overhead: DataParallelOverhead | None = None,
) -> StepTime:
    """Predicted seconds of one training step (forward, backward, gradient sync, AdamW).

    `dp_overhead`: what FSDP/DDP's wrapping added to a block, timed on this machine
    (measure/data_parallel_timing.py); None: the copies are estimated as memory-bound."""
    achieved = C.ACHIEVABLE_COMPUTE_FRACTION if hardware.achievable_fraction is None else hardware.achievable_fraction
    rate = hardware.peak_for(fp32_compute) * achieved * (C.COMPILE_SPEEDUP if compile else 1.0)
    stream = hardware.memory_bandwidth * C.ACHIEVABLE_MEMORY_FRACTION
    mbs, mode = place.microbatch_size, place.activation_checkpoint
    timed = hardware.times_the_model  # costs carry seconds timed at this microbatch size (measure/part_timing.py)
    forward, backward, weight_half = [], [], []
    splits = place.schedule.splits_backward
    tp_time = cp_time = ep_time = 0.0
    for stage in range(len(place.stage_layers)):
        parts = _stage_parts(costs, stage, place)
        if timed:
            fwd_s = sum(c * p.forward_seconds for p, c in parts)
            bwd_s = sum(c * (p.split_backward_seconds if splits else p.backward_seconds) for p, c in parts)
            weight_half.append(sum(c * p.weight_half_seconds for p, c in parts))
        else:
            # an attention that writes its score matrix out streams it through memory besides its FLOPs
            fwd_s = sum(c * (p.forward_flops / rate + p.forward_score_bytes / stream) for p, c in parts) * mbs
            bwd_s = (
                sum(
                    c * ((p.flops - p.forward_flops) / rate + (p.score_bytes - p.forward_score_bytes) / stream)
                    for p, c in parts
                )
                * mbs
            )
        tp_bytes = sum(c * p.tp_bytes for p, c in parts) * mbs
        tp_count = sum(c * p.tp_collectives for p, c in parts)
        tp_s = 0.0
        if costs.tp > 1 and hardware.collective_times is not None:  # each as its kind was timed at its size
            tp_s = sum(c * _measured_collectives(p.tp_by_kind, mbs, costs.tp, hardware) for p, c in parts) * (
                1 - C.TP_HIDDEN_FRACTION
            )
        elif costs.tp > 1:
            tp_s = (tp_bytes / links.tp + tp_count * hardware.collective_latency) * (1 - C.TP_HIDDEN_FRACTION)
        gather_s, reduce_s = _exchange_seconds(parts, mbs, links, hardware)
        dispatch_f, dispatch_b = _dispatch_seconds(parts, mbs, links, hardware)
        f = fwd_s + tp_s / 2 + gather_s + dispatch_f
        # a checkpoint's recompute gathers K and V again, the selective one too (it caches the
        # attention's result, not the all-gather before it)
        recompute = {
            "always": f,
            "except_last": f,
            "selective": C.SELECTIVE_RECOMPUTE_FRACTION * fwd_s + gather_s + dispatch_f,
        }
        # A stage without FLOPs (the embedding alone, layers_per_stage 0) still writes its output
        # (forward) and reads its gradient (backward) at the memory bandwidth.
        moved = costs.message_bytes * mbs / stream
        forward.append(max(f, moved))
        backward.append(max(bwd_s + tp_s / 2 + gather_s + reduce_s + dispatch_b + recompute.get(mode, 0.0), moved))
        tp_time = max(tp_time, tp_s)
        cp_time = max(cp_time, 2 * gather_s + reduce_s)
        ep_time = max(ep_time, dispatch_f + dispatch_b)
    # Each stage plays at its own costs: the ends (embedding, output layer and loss) are heavier
    # than a stage of blocks alone, and under interleaving only two of a rank's stages carry them.
    if not splits:
        w = [0.0] * len(backward)
    elif timed:  # the W half as timed, its share of the stage's collectives and recompute not included
        # A W timed at or over its whole backward (timer noise on a tiny stage; seen once in CI)
        # is held just under it: the simulator needs 0 <= w < b.
        w = [min(half, 0.999 * b) for half, b in zip(weight_half, backward)]
    else:
        w = [b * C.WEIGHT_GRAD_SHARE_OF_BACKWARD for b in backward]
    p2p = costs.message_bytes * mbs / links.pp + hardware.collective_latency if place.schedule.pp > 1 else 0.0
    report = simulate_schedule(place.schedule, f_cost=forward, b_cost=backward, w_cost=w, comm_cost=p2p)
    busy = max(report.busy)
    dp_s = _dp_seconds(costs, place, links, hardware, dp_overhead)
    if hardware.overlaps_communication:
        exposed = max(0.0, dp_s - busy) + C.DP_UNHIDDEN_FRACTION * dp_s
    else:
        exposed = dp_s
    params = max(rank_parameter_elements(costs, r, place) for r in range(place.schedule.pp))
    optimizer = params * C.ADAMW_BYTES_PER_PARAMETER / hardware.memory_bandwidth
    if place.dp > 1 or costs.tp > 1:  # the parameters are DTensors (wrap.py; tensor parallelism)
        optimizer += hardware.dtensor_update_overhead * max(
            _rank_parameter_tensors(costs, r, place) for r in range(place.schedule.pp)
        )
    return StepTime(
        report.makespan + exposed + optimizer,
        report.bubble_fraction,
        report.makespan,
        exposed,
        optimizer,
        tp_time,
        p2p,
        forward_seconds=tuple(forward),
        backward_seconds=tuple(backward),
        weight_grad_seconds=tuple(w),
        cp_seconds=cp_time,
        ep_seconds=ep_time,
    )


def _exchange_seconds(parts, mbs: int, links: Links, hardware: Hardware) -> tuple[float, float]:
    """(one pass's K/V all-gathers, the backward's dK/dV reduce-scatters) of a stage's microbatch under
    context parallelism: ring bytes over the cp group's link, a latency per collective; 0 at cp = 1."""
    calls = sum(c * p.cp.calls for p, c in parts)
    if not calls:
        return 0.0, 0.0
    gathered = sum(c * p.cp.gathered_bytes for p, c in parts) * mbs
    reduced = sum(c * p.cp.reduced_bytes for p, c in parts) * mbs
    latency = calls * hardware.collective_latency
    return (gathered / links.cp + latency) * (1 - C.CP_HIDDEN_FRACTION), (reduced / links.cp + latency) * (
        1 - C.CP_HIDDEN_FRACTION
    )


def _dispatch_seconds(parts, mbs: int, links: Links, hardware: Hardware) -> tuple[float, float]:
    """(a forward's, a backward's) all-to-alls of a stage's microbatch under expert parallelism: the
    routed rows over the ep group's link, none hidden (the experts wait for their rows, after a host
    stop for the counts), a latency for each; 0 at ep = 1."""
    forward_calls = sum(c * p.dispatches for p, c in parts)
    if not forward_calls:
        return 0.0, 0.0
    rows = 2 * sum(c * p.dispatch_bytes for p, c in parts) * mbs / links.ep  # the dispatch and the combine
    backward_calls = sum(c * 2 for p, c in parts if p.dispatches)
    return rows + forward_calls * hardware.collective_latency, rows + backward_calls * hardware.collective_latency


def _measured_collectives(by_kind: dict[str, tuple[float, int]], mbs: int, ranks: int, hardware: Hardware) -> float:
    """Seconds of a part's tensor-parallel collectives for a microbatch of `mbs` (measured at 1):
    each kind's count at the time that kind took at its mean size (every collective's message
    grows with the microbatch, as the activations it carries do). An end's part is a stage less a
    block: a kind it issues no more of than the block, but with more bytes, is charged those bytes
    as one collective."""
    seconds = 0.0
    for kind, (sent, count) in by_kind.items():
        if count > 0:
            seconds += count * hardware.collective_times.seconds(kind, sent * mbs / count, ranks)
        elif sent > 0:
            seconds += hardware.collective_times.seconds(kind, sent * mbs, ranks)
    return seconds


def _rank_parameter_tensors(costs: ModelCosts, rank: int, place: StagePlacement) -> int:
    """How many parameter tensors pp rank `rank` updates."""
    return sum(
        count * (len(part.param_shapes) + len(part.expert_shapes))
        for stage in range(len(place.stage_layers))
        if place.schedule.stage_rank(stage) == rank
        for part, count in _stage_parts(costs, stage, place)
    )


def _dp_seconds(
    costs: ModelCosts,
    place: StagePlacement,
    links: Links,
    hardware: Hardware,
    overhead: DataParallelOverhead | None = None,
) -> float:
    """FSDP: gather the parameters and reduce-scatter the gradients; DDP: all-reduce the gradients.
    One collective per wrapped module (each block, and each stage's root for the ends) and pass.
    Kept gathered (reshard_after_forward False, parallelize's default at pp > 1) FSDP gathers once
    per step; resharding after each forward (the default at pp = 1), every microbatch's forward
    and backward gather again (data_parallel/wrap.py). A machine with measured collectives (`Hardware.collective_times`)
    gives each its measured time at its size; otherwise ring traffic per rank over the link, plus
    the latency per collective. Under HSDP all of this runs within a group (`place.dp`, a node's
    ranks) and each group's reduced shard is all-reduced between groups on top (_across_replicas).
    Under ep the experts' gradients are counted with the rest, over
    dp x cp: their own group (dp x cp x tp / ep) moves (n - 1)/n of them, a share this leaves out."""
    return _within_groups_seconds(costs, place, links, hardware, overhead) + _across_replicas(
        costs, place, links, hardware
    )


def _within_groups_seconds(
    costs: ModelCosts,
    place: StagePlacement,
    links: Links,
    hardware: Hardware,
    overhead: DataParallelOverhead | None = None,
) -> float:
    """_dp_seconds within each data-parallel group (all of dp x cp but under HSDP)."""
    dp = place.dp
    if dp == 1:
        return 0.0
    pp = place.schedule.pp
    regathers = place.reshards
    gathers = 2 * place.schedule.microbatches if regathers else 1
    grad_bytes = 4  # reduce_dtype fp32
    share = (dp - 1) / dp
    wrapped = 0.0
    unsharded = max(rank_parameter_elements(costs, r, place, sharded=False) for r in range(pp))
    if overhead is not None:  # timed: hooks, copies and accumulation, per microbatch, scaled by the rank's parameters
        m, scale = place.schedule.microbatches, unsharded / overhead.elements
        if place.dp_mode == "fsdp" and regathers:
            wrapped = m * overhead.regathered
        else:  # kept gathered (reshard_after_forward False) or replicated; the first gather once
            wrapped = m * overhead.gathered + (overhead.regathered - overhead.gathered) / 2
        wrapped = scale * (wrapped + overhead.reduced)
    if hardware.collective_times is not None:
        times = hardware.collective_times

        def moved(elements: int) -> float:  # one module's collectives in a step, as measured
            if place.dp_mode == "ddp":
                return times.seconds("all_reduce", 2 * share * elements * grad_bytes, dp)
            return gathers * times.seconds("all_gather", share * elements * place.compute_bytes, dp) + times.seconds(
                "reduce_scatter", share * elements * grad_bytes, dp
            )

        return wrapped + max(sum(moved(e) for e in _rank_module_elements(costs, r, place) if e) for r in range(pp))
    latency = hardware.collective_latency
    # a module without parameters of its own (a middle stage's root) issues no collective
    modules = max(sum(1 for e in _rank_module_elements(costs, r, place) if e) for r in range(pp))
    if place.dp_mode == "ddp":
        return 2 * share * unsharded * grad_bytes / links.dp + modules * latency + wrapped
    traffic = share * unsharded * (gathers * place.compute_bytes + grad_bytes) / links.dp
    if overhead is not None:
        return traffic + wrapped + modules * (gathers + 1) * latency
    # Each gather copies the shards into the flat buffer and the gathered buffer out into the
    # parameters; the reduce-scatter copies the gradients in: read and write, memory-bound.
    copies = 2 * unsharded * (gathers * place.compute_bytes + grad_bytes) / hardware.memory_bandwidth
    return traffic + copies + modules * (gathers + 1) * latency


def _across_replicas(costs: ModelCosts, place: StagePlacement, links: Links, hardware: Hardware) -> float:
    """HSDP's all-reduce of each rank's reduced gradient shard (fp32) between its replica groups,
    once per step (ring: 2 (r - 1)/r of the shard over the cross-node link); 0 without HSDP."""
    r = place.replicas
    if r == 1:
        return 0.0
    shard = max(rank_parameter_elements(costs, rank, place) for rank in range(place.schedule.pp)) * 4
    if hardware.collective_times is not None:
        return hardware.collective_times.seconds("all_reduce", 2 * (r - 1) / r * shard, r)
    return 2 * (r - 1) / r * shard / links.replicas + hardware.collective_latency


def _rank_module_elements(costs: ModelCosts, rank: int, place: StagePlacement) -> list[int]:
    """Unsharded parameter elements of each module pp rank `rank` wraps for data parallelism: every
    block of its stages, and each stage's root (which holds the ends' parameters, if any)."""
    block = sum(math.prod(shape) for shape in costs.block.param_shapes)
    experts = sum(math.prod(shape) for shape in costs.block.expert_shapes)  # wrapped on their own under ep
    modules = []
    for stage in place.schedule.local_stages(rank):
        modules += [block, experts] * len(place.stage_layers[stage])
        modules.append(
            sum(
                count * sum(math.prod(shape) for shape in part.param_shapes)
                for part, count in _stage_parts(costs, stage, place)
                if part is not costs.block
            )
        )
    return modules
