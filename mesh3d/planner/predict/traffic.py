"""The bytes one rank puts on the wire in a step, by the kind of group they go over.

The same unit as the dry run's count of what the code issues (distributed/traffic_count.py
`wire_bytes`: ring algorithms), so a dry run holds these figures to the real code
(tests/distributed/test_dry_run_planner.py):

- "pipeline": a boundary message (a stage's output forward, its input's gradient back) for every
  F and backward whose neighbour stage lives on another pp rank, from the schedule's own lists;
- "tp": what the probe counted a part's tensor-parallel collectives sending (measure/meters.py
  CollectiveBytes), per microbatch and part of this rank's stages, and once per step the
  all-reduce of the partial gradients of the parameters the plan left replicated;
- "cp": each attention call's K/V all-gathers (forward, and again in backward; each with the
  call's verdict) and its fp32 dK/dV reduce-scatter (measure/context_parallel.py);
- "dp", or "dp_cp" under cp (FSDP/DDP over dp x cp, torch's flattened dim): FSDP gathers each
  module's padded shard and reduce-scatters its fp32 gradient once per step while the parameters
  stay gathered (reshard_after_forward False, the default at pp > 1), or at each microbatch's
  forward and backward when resharding; DDP all-reduces the fp32 gradients once per step; the
  last stage's ranks sum the loss's token counts per microbatch over the same group;
- under HSDP, "dp_shard" ("dp_shard_cp" under cp): FSDP's traffic as above within a sharding
  group, and "dp_replicate": once a step, the all-reduce of each rank's fp32 gradient shard
  between the groups; the token counts still go over the whole "dp" ("dp_cp");
- under ep, "edp": the split experts' FSDP (or DDP) over the ranks holding the same experts, as
  "dp" above.

What it leaves out, said where it is returned: under ep, its all-to-alls ("ep"), whose bytes follow
the router's choices, and "tp", where each tp rank dispatches its own rows and gathers the
combined ones back (expert_parallel/token_dispatch.py), which the probe's whole-expert block does
not run; the agreements' few bytes over the world.
"""

from __future__ import annotations

import math

from mesh3d.pipeline.schedule.ir import BACKWARD_INPUT, Kind
from mesh3d.planner.measure.costs import ModelCosts
from mesh3d.planner.predict.memory import StagePlacement, _shard_rows, _stage_parts

GRADIENT_BYTES = 4  # FSDP's and DDP's reduce dtype: fp32
COUNT_BYTES = 8  # a pair loss's token count per microbatch (step/global_loss.py), int64


def traffic_unpredicted(ep: int) -> str:
    """What `rank_traffic` gives no figure for in this layout ("" where it gives all)."""
    if ep > 1:
        return (
            "under expert parallelism its all-to-alls (ep), which follow the router's choices, and the "
            "token dispatch's tp gathers are not predicted"
        )
    return ""


def rank_traffic(costs: ModelCosts, rank: int, place: StagePlacement) -> dict[str, float]:
    """Bytes pp rank `rank` (its dp, cp and tp rank 0) sends in one step, by group kind."""
    microbatches = place.schedule.microbatches
    stages = place.schedule.local_stages(rank)
    parts = [pc for s in stages for pc in _stage_parts(costs, s, place)]
    sent = {"pipeline": _messages(place, rank) * costs.message_bytes * place.microbatch_size}
    if costs.tp > 1 and costs.ep == 1:  # under ep: traffic_unpredicted
        replicated = sum(c * p.tp_replicated_elements for p, c in parts) * place.param_bytes
        per_step = 2 * (costs.tp - 1) / costs.tp * replicated  # their partial gradients summed
        sent["tp"] = microbatches * place.microbatch_size * sum(c * p.tp_bytes for p, c in parts) + per_step
    if costs.cp > 1:
        per_sequence = sum(c * (2 * p.cp.gathered_bytes + p.cp.reduced_bytes) for p, c in parts)
        # each gather carries the call's verdict too: one element of the compute dtype, per microbatch
        verdicts = sum(c * 2 * p.cp.calls * (costs.cp - 1) * p.cp.element_size for p, c in parts)
        sent["cp"] = microbatches * (place.microbatch_size * per_sequence + verdicts)
    data_ranks = place.dp * place.replicas  # dp x cp
    if data_ranks > 1:
        whole = "dp_cp" if costs.cp > 1 else "dp"
        counts = 0.0
        if place.schedule.n_stages - 1 in stages:  # the loss's token counts per microbatch (int64), summed
            counts = 2 * (data_ranks - 1) / data_ranks * microbatches * COUNT_BYTES
        if place.hybrid:  # its groups, even with one replica (dp_shard = dp)
            sent["dp_shard_cp" if costs.cp > 1 else "dp_shard"] = _data_parallel(costs, stages, place)
            sent["dp_replicate"] = _across_replicas(costs, stages, place)
            if counts:
                sent[whole] = counts
        else:
            sent[whole] = _data_parallel(costs, stages, place) + counts
    if place.expert_dp > 1:
        sent["edp"] = _data_parallel(costs, stages, place, experts=True)
    return sent


def _messages(place: StagePlacement, rank: int) -> int:
    """Boundary messages this rank sends in a step: one per F whose next stage, and per backward
    whose previous stage, is another rank's (stages on one rank hand over in memory)."""
    schedule, last = place.schedule, place.schedule.n_stages - 1
    count = 0
    for action in schedule.actions[rank]:
        if action.kind == Kind.F and action.stage < last:
            count += schedule.stage_rank(action.stage + 1) != rank
        elif action.kind in BACKWARD_INPUT and action.stage > 0:
            count += schedule.stage_rank(action.stage - 1) != rank
    return count


def _data_parallel(costs: ModelCosts, stages: list[int], place: StagePlacement, experts: bool = False) -> float:
    """FSDP's gathers and reduce-scatters, or DDP's all-reduces, of this rank's modules in a step
    (`experts`: of its split experts, over the ranks holding the same ones)."""
    n = place.expert_dp if experts else place.dp
    held = sum(c * _shards(p, n, place, experts) for s in stages for p, c in _stage_parts(costs, s, place))
    if place.dp_mode == "ddp":
        return 2 * (n - 1) / n * held * GRADIENT_BYTES
    gathers = 2 * place.schedule.microbatches if place.reshards else 1  # resharding: each forward and backward
    return (n - 1) * held * (gathers * place.compute_bytes + GRADIENT_BYTES)


def _across_replicas(costs: ModelCosts, stages: list[int], place: StagePlacement) -> float:
    """HSDP's all-reduce of this rank's reduced fp32 gradient shard between the replica groups."""
    r = place.replicas
    held = sum(c * _shards(p, place.dp, place) for s in stages for p, c in _stage_parts(costs, s, place))
    return 2 * (r - 1) / r * held * GRADIENT_BYTES


def _shards(part, n: int, place: StagePlacement, experts: bool = False) -> int:
    """Elements of a part's parameters (`experts`: its split experts') one rank holds (DDP: all of
    them, FSDP: its padded shard)."""
    shapes = part.expert_shapes if experts else part.param_shapes
    if place.dp_mode == "ddp":
        return sum(math.prod(s) for s in shapes)
    return sum(_shard_rows(s, n, "fsdp") for s in shapes)
