"""What expert parallelism (ep > 1, expert_parallel/) changes in a measured block, from two probes at
the same tp: the model's own plan, and that plan without the experts modules' entries (as
`parallelize` gives way to ep, expert_parallel/apply.py).

- parameters: the experts' weights whole (the second probe's shapes), E/ep of them per rank, kept
  apart (`PartCosts.expert_shapes`) because data parallelism shards them over the ranks that hold
  the same experts (dp x cp x tp / ep), not over dp x cp; the block's other parameters as measured;
- tensor-parallel traffic: the second probe's (the experts' own collectives gone), plus the
  all-gather over tp of the combined tokens (each tp rank dispatches its share of the group's tokens);
- the all-to-alls: per forward, one of the routed-token counts (its latency: the layer's one host
  stop) and two of rows (the dispatch and the combine), each sending (ep - 1)/ep of the rank's
  routed rows (its tokens / tp, top_k each, hidden wide, in the compute dtype); per backward, the
  two of rows again;
- FLOPs and saved activations: the first probe's. A rank computes its experts on the rows it
  receives: balanced, its tokens / tp times top_k through whole experts, what it computes at
  ep = 1 on every routed row through each expert's tp slice.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from mesh3d.expert_parallel.plan import ExpertPlan
from mesh3d.planner.measure.costs import ModelCosts

# Attributes transformers' configs name the experts each token is routed to by.
TOP_K_ATTRIBUTES = ("num_experts_per_tok", "moe_topk", "num_selected_experts", "top_k")


def routing_sizes(model: nn.Module) -> tuple[int, int] | None:
    """(top_k, hidden) of a Hugging Face mixture of experts; None where its config names neither."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = next((getattr(text, a) for a in TOP_K_ATTRIBUTES if isinstance(getattr(text, a, None), int)), None)
    hidden = getattr(text, "hidden_size", None)
    return None if top_k is None or not isinstance(hidden, int) else (top_k, hidden)


def without_experts(tp_plan: dict | None, plan: ExpertPlan) -> dict | None:
    """The tensor-parallel plan `parallelize` applies beside ep: the experts modules' entries gone."""
    return None if tp_plan is None else {name: style for name, style in tp_plan.items() if not plan.matches(name)}


def at_expert_parallel(
    split: ModelCosts, whole: ModelCosts, plan: ExpertPlan, ep: int, top_k: int, hidden: int
) -> ModelCosts:
    """`split` (measured with the model's tp plan) as one rank runs its block at `ep`; `whole`: the
    same block measured with the experts' tp entries dropped (the same costs at tp = 1)."""
    expert = [plan.matches(name.rpartition(".")[0]) for name in whole.block.param_names]
    if not any(expert):
        raise ValueError(f"plan: no parameter of the measured block belongs to an experts module {plan.patterns}")
    shapes = [shape for shape, e in zip(whole.block.param_shapes, expert) if not e]
    names = [name for name, e in zip(whole.block.param_names, expert) if not e]
    experts = [(shape[0] // ep, *shape[1:]) for shape, e in zip(whole.block.param_shapes, expert) if e]
    element = whole.dtype.itemsize
    rows = whole.seq_len / whole.tp * top_k  # routed rows a rank sends per sequence of a microbatch
    sent = rows * hidden * element * (ep - 1) / ep
    by_kind = dict(whole.block.tp_by_kind)
    tp_bytes, tp_count = whole.block.tp_bytes, whole.block.tp_collectives
    if whole.tp > 1:  # the combined tokens' all-gather forward; backward, slicing its gradient sends nothing
        gathered = whole.seq_len * hidden * element * (whole.tp - 1) / whole.tp
        sent_before, count_before = by_kind.get("all_gather", (0.0, 0))
        by_kind["all_gather"] = (sent_before + gathered, count_before + 1)
        tp_bytes, tp_count = tp_bytes + gathered, tp_count + 1
    block = dataclasses.replace(
        split.block,
        param_shapes=tuple(shapes),
        param_names=tuple(names),
        expert_shapes=tuple(experts),
        tp_bytes=tp_bytes,
        tp_collectives=tp_count,
        tp_by_kind=by_kind,
        dispatch_bytes=sent,
        dispatches=3,
    )
    return dataclasses.replace(split, block=block, ep=ep)
