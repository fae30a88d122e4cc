"""What the probe measures of a model, per microbatch on one tp rank: a block's and the two ends'
parameters, saved activations, FLOPs and tensor-parallel traffic (probe.py), under context
parallelism what one cp rank runs and exchanges (context_parallel.py), and, on a machine the
planner times, their seconds (part_timing.py). The predictions (predict/) read these."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionExchange:
    """What context parallelism's attention (context_parallel/attention.py) adds to a part on one cp
    rank, per sequence of a microbatch: every attention call all-gathers the whole sequence's K and
    V in its forward, again in its backward, and reduce-scatters their gradients in fp32. Zero at cp = 1."""

    calls: int = 0  # attention calls: each one all-gather forward, one all-gather and one reduce-scatter backward
    gathered_bytes: float = 0.0  # bytes this rank sends in one forward's all-gathers (ring: (cp-1) x its K and V)
    reduced_bytes: float = 0.0  # bytes it sends in the backward's reduce-scatters ((cp-1)/cp of the fp32 dK, dV)
    # The largest call's whole-sequence K and V (compute dtype): the predictions hold one call's
    # buffers at a time (predict/memory.py).
    whole_kv_bytes: int = 0
    element_size: int = 0  # of the compute dtype
    kv_groups: int = 1  # query heads per K/V head in that call (the GPU kernels' expanded dK/dV)
    # The attention's FLOPs as the rank runs them (counted in the part's: forward, its rerun in
    # backward and backward, over the keys its row blocks attend), and as MFU counts a model's
    # (forward and backward over the whole score matrix, as the probe counts them at cp = 1).
    run_flops: float = 0.0
    model_flops: float = 0.0
    float_masks: int = 0  # calls with an additive mask, which mesh3d refuses under cp (model_check.py)

    def minus(self, other: AttentionExchange) -> AttentionExchange:
        """What a stage's end adds beyond its block: the additive counts' difference; the largest
        call's buffers only where the end attends itself."""
        calls = self.calls - other.calls
        return AttentionExchange(
            calls,
            self.gathered_bytes - other.gathered_bytes,
            self.reduced_bytes - other.reduced_bytes,
            self.whole_kv_bytes if calls else 0,
            self.element_size,
            self.kv_groups,
            self.run_flops - other.run_flops,
            self.model_flops - other.model_flops,
            self.float_masks - other.float_masks,
        )


@dataclass(frozen=True)
class PartCosts:
    """One part of a model (a block, or an end), per microbatch, on one tp rank."""

    param_shapes: tuple[tuple[int, ...], ...] = ()  # local (tp-sharded) shapes of its parameters
    param_names: tuple[str, ...] = ()
    saved: dict[str, int] = field(default_factory=dict)  # activation_checkpoint mode -> saved bytes
    flops: float = 0.0  # forward + backward
    forward_flops: float = 0.0
    tp_bytes: float = 0.0  # bytes this rank sends through tensor-parallel collectives, forward + backward
    tp_collectives: int = 0  # how many tensor-parallel collectives it issues, forward + backward
    # the same by kind ("all_gather", "reduce_scatter", "all_reduce"): (bytes sent, count), so a
    # machine that timed each kind by size (hardware.CollectiveTimes) charges each its own time
    tp_by_kind: dict[str, tuple[float, int]] = field(default_factory=dict)
    # Seconds one microbatch takes on this machine (forward; backward), when the hardware times the
    # model's own parts (`Hardware.times_the_model`, "this-machine"); 0 when it is not timed.
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    # The same backward split in two as zero-bubble schedules run it (pipeline/backward_halves.py):
    # both halves, and the weight half alone. Walking the graph twice costs more than once.
    split_backward_seconds: float = 0.0
    weight_half_seconds: float = 0.0
    cp: AttentionExchange = field(default_factory=AttentionExchange)  # context parallelism's exchange
    # Under expert parallelism (measure/experts.py): the experts' weights as one ep rank holds them
    # (E/ep whole experts, apart from param_shapes: data parallelism shards them over the ranks that
    # hold the same experts), the bytes one all-to-all of rows sends per sequence of a microbatch, and
    # the all-to-alls a forward issues (a backward issues those of rows again).
    expert_shapes: tuple[tuple[int, ...], ...] = ()
    dispatch_bytes: float = 0.0
    dispatches: int = 0
    # Bytes moved through attention score matrices written out (meters.ScoreMatrixBytes), forward +
    # backward and forward alone: memory-bound time beside the FLOPs; 0 under a fused kernel.
    score_bytes: float = 0.0
    forward_score_bytes: float = 0.0
    # elements of its parameters a tp plan leaves replicated (a norm under sequence parallel): their
    # gradients arrive as partial sums, all-reduced over tp once per step (tensor/gradients.py)
    tp_replicated_elements: int = 0

    def minus(self, other: PartCosts, names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> PartCosts:
        return PartCosts(
            shapes,
            names,
            {k: v - other.saved.get(k, 0) for k, v in self.saved.items()},
            self.flops - other.flops,
            self.forward_flops - other.forward_flops,
            self.tp_bytes - other.tp_bytes,
            self.tp_collectives - other.tp_collectives,
            _by_kind_minus(self.tp_by_kind, other.tp_by_kind),
            cp=self.cp.minus(other.cp),
            score_bytes=self.score_bytes - other.score_bytes,
            forward_score_bytes=self.forward_score_bytes - other.forward_score_bytes,
            tp_replicated_elements=self.tp_replicated_elements - other.tp_replicated_elements,
        )


def _by_kind_minus(
    mine: dict[str, tuple[float, int]], other: dict[str, tuple[float, int]]
) -> dict[str, tuple[float, int]]:
    """What a stage issues beyond a block, per collective kind (no kind left out of either)."""
    none = (0.0, 0)
    return {
        kind: (mine.get(kind, none)[0] - other.get(kind, none)[0], mine.get(kind, none)[1] - other.get(kind, none)[1])
        for kind in {**mine, **other}
    }


@dataclass(frozen=True)
class ModelCosts:
    """A block and the two ends, per microbatch of `microbatch_size` x `seq_len`, at `tp`, `cp` and `ep`."""

    tp: int
    microbatch_size: int
    seq_len: int  # tokens of a sequence one rank holds: the whole sequence's / cp
    dtype: torch.dtype  # the compute dtype the activations are in
    block: PartCosts
    first_end: PartCosts
    last_end: PartCosts
    message_bytes: int  # what a stage sends on (and its gradient coming back), per microbatch
    # a whole stage under checkpoint keeps its input (and the last, the loss's saved tensors),
    # whatever its blocks: by stage kind "first", "middle", "last"
    checkpointed_stage: dict[str, int]
    cp: int = 1
    ep: int = 1
    # FLOPs a microbatch's backward runs again beyond the model's (the fused head's forward): in
    # the step's time, not in its MFU
    recomputed_flops: float = 0.0
