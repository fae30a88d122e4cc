"""What a model's parts take on this machine, timed: for a machine whose rate no datasheet states.

`hardware="this-machine"` (a CPU, gloo) says `times_the_model`: FLOPs over a matmul rate miss a
small model's norms, attention and elementwise ops, and DTensor's dispatch under tensor
parallelism. So the planner times the same three stages the probe measures (probe.py), for real,
and predict/step_time.py plays the schedule with these seconds instead.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import nn

from mesh3d.model.anatomy import Anatomy
from mesh3d.planner import constants as C
from mesh3d.planner.measure.costs import ModelCosts, PartCosts
from mesh3d.planner.measure.measured_stages import KINDS, MeasuredStages, StageFlow, measured_stages
from mesh3d.planner.measure.probe import _computed, _forward, _input, fake_tp_mesh


def time_model(
    model: nn.Module,
    anatomy: Anatomy,
    costs: ModelCosts,
    *,
    tp_plan: dict | None,
    microbatch_size: int,
    param_dtype: torch.dtype | None,
) -> ModelCosts:
    """`costs` with the seconds a microbatch of `microbatch_size` takes on this machine, per part.

    For a machine whose rate no datasheet states (a CPU, `Hardware.times_the_model`): the same three
    stages as `measure_model`, materialized on CPU with the model's own initialization, run forward
    and backward on one thread (as a CPU rank runs) with real tensors. Everything a block does is
    in that time: the matmuls at their real shapes, the norms, attention and elementwise ops
    between them, and with tp > 1 DTensor's dispatch over the fake process group (whose
    collectives move nothing; the planner adds their latency and bytes itself)."""
    from mesh3d.model.initialize import initialize
    from mesh3d.tensor.apply import apply_tensor_parallel

    measured = measured_stages(model, anatomy, microbatch_size, costs.seq_len)
    for kind, stage in measured.stages.items():
        if kind not in KINDS:  # a traced model's stages between: on meta, walked for their shapes only
            continue
        stage.to_empty(device="cpu")
        initialize(stage, measured.indices[kind], torch.device("cpu"), 0, anatomy.init_stage)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with fake_tp_mesh(costs.tp) as mesh:
            if mesh is not None:
                apply_tensor_parallel(measured.stages.values(), tp_plan, mesh)
            seconds = _time_chain(measured, microbatch_size, costs.seq_len, param_dtype)
    finally:
        torch.set_num_threads(threads)
    block = seconds["middle"]

    def end(kind: str) -> tuple[float, ...]:  # an end is its stage less a block (never below 0)
        return tuple(max(0.0, whole - one) for whole, one in zip(seconds[kind], block))

    def timed(part: PartCosts, times: tuple[float, ...]) -> PartCosts:
        return replace(
            part,
            forward_seconds=times[0],
            backward_seconds=times[1],
            split_backward_seconds=times[2],
            weight_half_seconds=times[3],
        )

    return replace(
        costs,
        block=timed(costs.block, block),
        first_end=timed(costs.first_end, end("first")),
        last_end=timed(costs.last_end, end("last")),
    )


def _time_chain(
    measured: MeasuredStages, batch: int, seq_len: int, param_dtype: torch.dtype | None
) -> dict[str, tuple[float, float, float, float]]:
    """Per stage: the best forward, backward, split backward (I + W) and W seconds. A stage that
    receives several tensors gets them joined into one, as the runtime does: its I ends there."""
    from mesh3d.pipeline.backward_halves import backward_input, backward_weight

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2, (batch, seq_len), generator=generator)  # token ids every vocabulary has
    targets = torch.randint(0, 2, (batch, seq_len), generator=generator)
    seconds = {}
    # In a step a part's weights and inputs come from memory, the other parts having run between
    # its forward and its backward: writing this much evicts them from the CPU's caches first.
    flush = torch.empty(C.CACHE_FLUSH_BYTES // 4)

    def timed(fn) -> float:
        flush.zero_()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for stage in measured.stages.values():
        _computed(stage, param_dtype)
    flow = StageFlow(measured, tokens)
    for kind in KINDS:
        stage, x = flow.stage_and_input(kind)
        is_last = kind == "last"
        best = [float("inf")] * 4
        for repeat in range(C.TIMING_REPEATS + 1):
            runs = []
            for split in (False, True):
                inp = _input(x)
                holder = {}
                forward = timed(lambda: holder.update(out=_forward(stage, inp, targets if is_last else None, "never")))
                out = holder["out"]
                grad = None if is_last else torch.ones_like(out)
                if not split:
                    runs += [forward, timed(lambda: torch.autograd.backward(out, grad))]
                elif inp.is_floating_point():  # I, then W, as the runtime runs them
                    pending = {}
                    first = timed(lambda: pending.update(p=backward_input(out, grad, inp)[1]))
                    second = timed(lambda: backward_weight(pending["p"]))
                    runs += [first + second, second]
                else:  # token ids in: the runtime's W is a whole backward
                    whole = timed(lambda: torch.autograd.backward(out, grad))
                    runs += [whole, whole]
                stage.zero_grad(set_to_none=True)
            if repeat:  # the first run warms up (allocations, DTensor's sharding caches)
                best = [min(b, r) for b, r in zip(best, runs)]
        seconds[kind] = tuple(best)
        if not is_last:
            flow.hand_on(kind, out)
    return seconds
