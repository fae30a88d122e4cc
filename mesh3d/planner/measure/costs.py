"""What the probe measures of a model, per microbatch on one tp rank: a block's and the two ends'
parameters, saved activations, FLOPs and tensor-parallel traffic (probe.py), and, on a machine the
planner times, their seconds (part_timing.py). The predictions (predict/) read these."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    """A block and the two ends, per microbatch of `microbatch_size` x `seq_len`, at `tp`."""

    tp: int
    microbatch_size: int
    seq_len: int
    dtype: torch.dtype  # the compute dtype the activations are in
    block: PartCosts
    first_end: PartCosts
    last_end: PartCosts
    message_bytes: int  # what a stage sends on (and its gradient coming back), per microbatch
    # a whole stage under checkpoint keeps its input (and the last, the loss's saved tensors),
    # whatever its blocks: by stage kind "first", "middle", "last"
    checkpointed_stage: dict[str, int]
