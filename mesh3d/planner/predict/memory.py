"""Bytes per rank at one layout: what mesh3d holds there, counted from the model's measured parts.

- parameters, gradients, AdamW state: each parameter of the rank's stages, its tensor-parallel
  shard (measured, measure/probe.py), then FSDP's dim-0 shard (torch.chunk: the first dp rank holds
  ceil(rows/dp) rows, the fullest) or DDP's replica; gradients and both AdamW moments as the
  parameters, in the parameters' dtype; a tied weight once per stage that holds it when data
  parallelism wraps the stages (each stage is its own root), else once per rank;
  under ep, a block's experts are E/ep whole experts (measure/experts.py), sharded over the ranks
  that hold the same experts (dp x cp x tp / ep) instead;
- activations: the rank's own action list walked in order (its order is its time), each forward
  adding what its mode keeps, each backward (B, or W after I) releasing it; parameters a forward
  saves are not activations (the probe's meter skips them: they are held once, as parameters or
  FSDP's gathered copy, not once per microbatch in flight); the first stage's token ids are the
  whole local batch's while any of its microbatches is held (the microbatches are views of it);
- recompute: the most a recomputation adds during a backward: one block's activations where the
  runtime checkpoints block by block (schedules with one backward), the whole stage's where it
  recomputes a stage at once (a split backward's I, held until W);
- communication: FSDP's gathered (unsharded) parameters (resharded after each forward: two blocks, the stage's own
  parameters outside its blocks, which FSDP's root keeps gathered from forward to backward, and
  the flat buffer they were gathered into) and, with several microbatches, the unsharded
  gradients it accumulates until the step's one reduction; DDP's compute-dtype copy; a receive
  buffer per boundary message;
- context_parallel: under cp, one attention call's whole-sequence buffers at a time (they are not
  kept between calls, context_parallel/attention.py): the gathered K and V, and in
  backward the fp32 sums of their gradients and a row block's gradients; the activations a cp rank
  keeps are measured on its own tokens (measure/context_parallel.py);
- optimizer_step: what AdamW's step adds beyond the backward's peak. Its foreach kernels (torch's
  default on CUDA) hold one temporary the size of the rank's parameters while every gradient is
  there, so a rank without data parallelism peaks in the step, not in the backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mesh3d.pipeline.schedule.ir import Kind, Schedule
from mesh3d.planner.measure.costs import ModelCosts, PartCosts


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes on one rank, by what holds them (`total` is their sum)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    recompute: int
    communication: int
    optimizer_step: int = 0
    context_parallel: int = 0

    @property
    def total(self) -> int:
        held = self.parameters + self.gradients + self.optimizer
        transient = self.communication + self.optimizer_step + self.context_parallel
        return held + self.activations + self.recompute + transient


@dataclass(frozen=True)
class StagePlacement:
    """The sizes `rank_memory` needs besides the measured costs."""

    schedule: Schedule
    stage_layers: list[range]
    dp: int  # the ranks a stage is sharded (or replicated) over: dp x cp, HSDP's dp_shard x cp
    dp_mode: str
    microbatch_size: int
    activation_checkpoint: str
    param_bytes: int  # element size of the parameters (the model's dtype)
    compute_bytes: int  # element size of the compute dtype
    wraps: bool  # data parallelism (or mixed precision) wraps each stage as its own root
    tied_end: bool  # the first and last ends share a weight
    # FSDP frees a block's gathered parameters after its forward; None: parallelize's default (pp = 1)
    reshard_after_forward: bool | None = None
    expert_dp: int = 1  # under ep: the ranks that hold the same experts (dp x cp x tp / ep)
    replicas: int = 1  # HSDP: the groups holding replicas (dp the ranks sharding within one)
    hybrid: bool = False  # HSDP (dp_mode "fsdp" within its groups), even of one group (replicas 1)

    @property
    def reshards(self) -> bool:
        return self.schedule.pp == 1 if self.reshard_after_forward is None else self.reshard_after_forward


def _shard_rows(shape: tuple[int, ...], dp: int, mode: str) -> int:
    """Elements the fullest dp rank holds of a parameter of this (tensor-parallel-local) shape."""
    if not shape:
        return 1
    rows = shape[0] if mode == "ddp" or dp == 1 else math.ceil(shape[0] / dp)
    return rows * math.prod(shape[1:])


def _stage_parts(costs: ModelCosts, stage: int, place: StagePlacement) -> list[tuple[PartCosts, int]]:
    n = len(place.stage_layers)
    parts = [(costs.block, len(place.stage_layers[stage]))]
    if stage == 0:
        parts.append((costs.first_end, 1))
    if stage == n - 1:
        parts.append((costs.last_end, 1))
    return parts


def stage_parameter_elements(costs: ModelCosts, stage: int, place: StagePlacement, sharded: bool = True) -> int:
    dp, edp = (place.dp, place.expert_dp) if sharded else (1, 1)
    return sum(
        count
        * (
            sum(_shard_rows(s, dp, place.dp_mode) for s in part.param_shapes)
            + sum(_shard_rows(s, edp, place.dp_mode) for s in part.expert_shapes)
        )
        for part, count in _stage_parts(costs, stage, place)
    )


def rank_expert_elements(costs: ModelCosts, rank: int, place: StagePlacement) -> int:
    """Unsharded elements of the experts pp rank `rank` holds under ep (0 at ep = 1)."""
    block = sum(math.prod(s) for s in costs.block.expert_shapes)
    return block * sum(len(place.stage_layers[s]) for s in place.schedule.local_stages(rank))


def _tied_elements(costs: ModelCosts, place: StagePlacement, sharded: bool = True) -> int:
    if not place.tied_end or not costs.first_end.param_shapes:
        return 0
    dp = place.dp if sharded else 1
    return _shard_rows(max(costs.first_end.param_shapes, key=math.prod), dp, place.dp_mode)


def rank_parameter_elements(costs: ModelCosts, rank: int, place: StagePlacement, sharded: bool = True) -> int:
    """Parameter elements pp rank `rank` holds (dp rank 0, the fullest)."""
    stages = place.schedule.local_stages(rank)
    total = sum(stage_parameter_elements(costs, s, place, sharded) for s in stages)
    n = len(place.stage_layers)
    if 0 in stages and n - 1 in stages and not place.wraps:
        total -= _tied_elements(costs, place, sharded)  # one Parameter for both stages
    return total


def _per_block(place: StagePlacement, stage: int) -> bool:
    """Whether the runtime checkpoints this stage block by block (pipeline/activation_checkpoint.py):
    schedules with one backward, a stage that has blocks. A split backward (I, then W over one
    graph) recomputes the whole stage at I instead."""
    return not place.schedule.splits_backward and len(place.stage_layers[stage]) > 0


def _ends(costs: ModelCosts, stage: int, place: StagePlacement) -> int:
    """Bytes the stage's ends (embedding; final norm, head and loss) keep: never checkpointed."""
    n = len(place.stage_layers)
    return (costs.first_end.saved["never"] if stage == 0 else 0) + (
        costs.last_end.saved["never"] if stage == n - 1 else 0
    )


def _kept(costs: ModelCosts, stage: int, place: StagePlacement, mode: str) -> int:
    """Bytes a forward of `stage` keeps for its backward, per microbatch, under `mode`.

    Per block ("always"): each block's input (what a checkpoint of one block keeps, measured as
    the middle stage's), and the ends' whole; "selective" adds each block's cached results."""
    n = len(place.stage_layers)
    if mode in ("always", "selective") and _per_block(place, stage):
        per_block = costs.checkpointed_stage["middle"] + (costs.block.saved["selective"] if mode == "selective" else 0)
        return (len(place.stage_layers[stage]) * per_block + _ends(costs, stage, place)) * place.microbatch_size
    if mode == "selective":  # the stage's input (token ids: those of the first stage) and the cache
        taken = costs.checkpointed_stage["first"] if stage == 0 else costs.message_bytes
        return (
            taken + sum(count * part.saved["selective"] for part, count in _stage_parts(costs, stage, place))
        ) * place.microbatch_size
    if mode == "always":
        kept = costs.checkpointed_stage
        if n == 1:  # the stage takes the tokens and computes the loss
            return (kept["first"] + kept["last"] - kept["middle"]) * place.microbatch_size
        kind = "first" if stage == 0 else "last" if stage == n - 1 else "middle"
        return kept[kind] * place.microbatch_size
    return sum(count * part.saved[mode] for part, count in _stage_parts(costs, stage, place)) * place.microbatch_size


def rank_activations(costs: ModelCosts, rank: int, place: StagePlacement) -> tuple[int, int]:
    """(peak bytes kept for backward, the most a recomputation adds on top) on pp rank `rank`.

    The first stage's microbatches are views of the step's input (the runtime chunks it), so the
    token ids a first-stage forward keeps hold the whole local batch's: counted once, from the
    first such forward to the last backward, instead of once per microbatch."""
    mode, m = place.activation_checkpoint, place.schedule.microbatches
    ids = costs.checkpointed_stage["first"] * place.microbatch_size  # one microbatch's token ids
    held: dict[tuple[int, int], int] = {}
    live = peak = peak_with_recompute = first_held = 0
    kept_as = "selective" if mode == "selective" else "always"
    kept = {
        s: (_kept(costs, s, place, "never"), _kept(costs, s, place, kept_as)) for s in place.schedule.local_stages(rank)
    }
    by_block = {s: _per_block(place, s) for s in kept}
    for action in place.schedule.actions[rank]:
        key = (action.stage, action.microbatch)
        checkpointed = mode in ("always", "selective") or (mode == "except_last" and action.microbatch != m - 1)
        full, checkpoint_kept = kept[action.stage]  # full: what a recompute rebuilds for the backward
        # what a recompute in B adds on top: one block at a time, or the whole stage
        per_block = by_block[action.stage]
        rebuilt = (
            costs.block.saved["never"] * place.microbatch_size
            if per_block
            else full - (ids if action.stage == 0 else 0)
        )
        first_stage_before = first_held > 0
        if action.kind == Kind.F:
            held[key] = checkpoint_kept if checkpointed else full
            if action.stage == 0:
                held[key] -= ids
                first_held += 1
            live += held[key]
        elif action.kind == Kind.I and checkpointed:  # a split backward recomputes at I, keeps it for W
            # ("selective" recomputes before B too: its transient is counted at B like "always"'s)
            live += full - (ids if action.stage == 0 else 0)
            held[key] += full - (ids if action.stage == 0 else 0)
        elif action.kind in (Kind.B, Kind.W):
            if action.kind == Kind.B and checkpointed:
                peak_with_recompute = max(peak_with_recompute, live + rebuilt)
            live -= held.pop(key)
            first_held -= action.stage == 0
        first_stage_now = first_held > 0
        live += (first_stage_now - first_stage_before) * ids * m
        peak = max(peak, live)
        peak_with_recompute = max(peak_with_recompute, live)
    return peak, peak_with_recompute - peak


def rank_memory(
    costs: ModelCosts, rank: int, place: StagePlacement, kept: tuple[int, int] | None = None
) -> MemoryBreakdown:
    """The peak bytes of pp rank `rank` (its fullest dp and tp rank) at this placement; `kept`:
    its `rank_activations`, when already walked (they do not depend on dp)."""
    params = rank_parameter_elements(costs, rank, place) * place.param_bytes
    activations, recompute = kept if kept is not None else rank_activations(costs, rank, place)
    unsharded = rank_parameter_elements(costs, rank, place, sharded=False)
    experts = rank_expert_elements(costs, rank, place)
    blocks = sum(len(place.stage_layers[s]) for s in place.schedule.local_stages(rank))
    comm = 0
    # The experts (under ep) are FSDP's or DDP's over their own group, wrapped even where it is one
    # rank (data_parallel/wrap.py); the rest over dp x cp.
    for elements, gathers, block_shapes in (
        (unsharded - experts, place.dp > 1, costs.block.param_shapes),
        (experts, experts > 0, costs.block.expert_shapes),
    ):
        if place.dp_mode == "fsdp" and gathers:
            if not place.reshards:  # gathered from the first forward to the last backward
                comm += elements * place.compute_bytes
            else:  # a block at a time, the next one prefetched; the root's own parameters kept, and their flat buffer
                block = sum(math.prod(s) for s in block_shapes)
                own = elements - blocks * block
                comm += (min(2, blocks) * block + 2 * own) * place.compute_bytes
            if place.schedule.microbatches > 1:
                # Reduced once per step (data_parallel/gradient_sync.py): until the last backward FSDP
                # accumulates each gathered parameter's whole gradient, beside the reduced shards.
                comm += elements * place.param_bytes
        elif place.wraps and place.compute_bytes != place.param_bytes:
            comm += elements * place.compute_bytes  # the compute-dtype copy of every parameter
    comm += 2 * costs.message_bytes * place.microbatch_size * len(place.schedule.local_stages(rank))
    holds_blocks = any(place.stage_layers[s] for s in place.schedule.local_stages(rank))
    whole = _whole_sequence_bytes(costs.block, place.microbatch_size) if holds_blocks else 0
    during_backward = activations + recompute + comm + whole
    optimizer_step = max(0, params - during_backward)  # foreach AdamW's one parameter-sized temporary
    return MemoryBreakdown(params, params, 2 * params, activations, recompute, comm, optimizer_step, whole)


def _whole_sequence_bytes(block: PartCosts, microbatch_size: int) -> int:
    """The most one context-parallel attention call holds at once (0 at cp = 1), in the order
    context_parallel/attention.py allocates its backward, the fuller pass: the whole K and V (W,
    for the microbatch), the fp32 sums of their gradients by owner (W x 4 / b), a row block's dK
    and dV (at most W) and the fp32 copy of one of them (none from fp32). With grouped K/V heads
    (g queries' heads a K/V head) the GPU's kernels hold more in that backward: flash its dK and dV
    per query head (g x W) before summing them, the memory-efficient kernel (fp32) K and V repeated
    to the query heads and their gradients (2g x W). The forward holds 2W at most (the gather's
    buffer beside K and V). A causal call builds no mask on a GPU (on the CPU,
    row blocks of MASK_PAIRS pairs); packed documents' mask rows are not planned
    (measure/context_parallel.py)."""
    cp = block.cp
    if not cp.calls:
        return 0
    kv, b = cp.whole_kv_bytes * microbatch_size, cp.element_size
    fp32_copy = kv // 2 * 4 // b if b < 4 else 0
    groups = cp.kv_groups
    expanded = 0 if groups == 1 else groups * kv if b < 4 else 2 * groups * kv
    return kv + kv * 4 // b + kv + fp32_copy + expanded
