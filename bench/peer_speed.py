"""mesh3d's pipeline engine against torch.distributed.pipelining, on the same stages of the same model.

    OMP_NUM_THREADS=1 python bench/peer_speed.py --pp 2 --microbatches 8 --steps 10

One process group of `pp` ranks (gloo, CPU, one thread each) builds one LLaMA-style model with the
same weights for both engines and the same split (`--layers` blocks, an equal number per stage;
the embedding on the first stage, the final norm and head on the last). Each engine runs its
interleaved 1F1B (2 stages per rank, loop placement) and its ZBV (2 stages per rank, V placement:
rank r holds stages r and 2pp-1-r); torch's ZBV splits the backward with its own
`stage_backward_input`/`stage_backward_weight`, ours with pipeline/backward_halves.py. Steps take
turns on the same batches (mesh3d interleaved, torch interleaved, mesh3d zbv, torch zbv, then one
process), the four engines' order rotating by one every round, so load from elsewhere on the
machine and the allocator's state after the previous step fall on all of them alike; each step is
timed between barriers (the slowest rank) and the figure is the median.

"One process" is the whole model's forward and backward on the whole batch, on rank 0 alone with
one thread (the other ranks wait in a barrier). Pipeline efficiency is (one process / pp) / step
time: 1.0 is a perfect pp-fold speed-up; bubbles, messages and per-action overhead take it down.
On a CPU the whole batch at once runs slower per token than microbatches (its activations do
not stay in cache), which can put that efficiency above 1; the bench therefore also times one
process running the same microbatches one after another with gradient accumulation, the
pipeline's own compute on one rank, and prints the efficiency against it too.
Losses of the two engines on the same batch are printed side by side as a check that they compute
the same thing.

Each engine's step is also cut in two. Compute is each rank's time inside its stages' forward
and backward calls, waits for messages excluded: torch's `forward_one_chunk`/`backward_one_chunk`/
`backward_weight_one_chunk` (which its schedules call after their receives completed), its loss
and its final division of the gradients by m; mesh3d's F/B/I/W less the time in `Mailbox.take`.
The rest of the step is the step time less the busiest rank's compute: waits, messages, the
interpreter. No schedule can take less than its busiest rank's compute, so the compute column
bounds what a better engine could gain on the same stages.

Each engine's peak saved activations per rank are measured the same way for all four: its step
runs inside `torch.autograd.graph.saved_tensors_hooks` with a SavedBytesMeter of its own
(mesh3d.planner.measure.meters, the planner's meter: distinct storages at their allocated size, released
when autograd drops its last saved reference, parameters and views of them not counted; both
engines' stages hold plain Parameters here, no FSDP). One round after the timed ones, untimed, is
metered, so the hooks' cost stays out of the timings (not the warm-up: torch's first step also
runs each stage's forward once more, autograd on, to infer the messages' shapes). The meter sees
what autograd saves for backward inside the step, the loss's included, and nothing else:
not what an engine holds outside autograd for its backwards (each stage-microbatch's output,
kept to start the backward from: torch's forward cache, mesh3d's step state), receive buffers
that no op saved, gradients, parameters, or a tensor that lives only inside one action.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from multiprocess import run_on_ranks  # noqa: E402
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble  # noqa: E402
from torch.distributed.pipelining.schedules import _PipelineSchedule  # noqa: E402
from torch.distributed.pipelining.stage import _PipelineStageBase  # noqa: E402

import mesh3d  # noqa: E402
from examples.llama.config import get_config  # noqa: E402
from examples.llama.model import Transformer  # noqa: E402
from mesh3d.pipeline import p2p, stage_compute  # noqa: E402
from mesh3d.planner.measure.meters import SavedBytesMeter  # noqa: E402

TORCH_SCHEDULES = {"interleaved_1f1b": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble}


def _model(args) -> Transformer:
    torch.manual_seed(0)
    config = get_config(
        "debug",
        max_seq_len=args.seq_len,
        dim=args.dim,
        n_heads=args.dim // 32,
        n_kv_heads=args.dim // 32,
        n_layers=args.layers,
    )
    return Transformer(config)


def _stage_indices(schedule: str, pp: int, rank: int) -> list[int]:
    return [rank, 2 * pp - 1 - rank] if schedule == "zbv" else [rank, rank + pp]


def _torch_stage(model: Transformer, stage: int, n_stages: int) -> torch.nn.Module:
    """The torch side's stage module: the model with only this stage's blocks (the model protocol
    lets the same class run one stage)."""
    module = copy.deepcopy(model)
    per_stage = len(model.layers) // n_stages
    keep = {str(i) for i in range(stage * per_stage, (stage + 1) * per_stage)}
    for key in list(module.layers.keys()):
        if key not in keep:
            del module.layers[key]
    if stage > 0:
        module.tok_embeddings = None
    if stage < n_stages - 1:
        module.norm = module.output = None
    return module


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


class _ComputeClock:
    """Seconds this rank spent computing since `reset`: inside both engines' stage calls, less the
    time mesh3d's calls waited for a message inside them."""

    def __init__(self):
        self.seconds = 0.0
        for owner, names, sign in (
            (
                _PipelineStageBase,
                ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "scale_grads"),
                1,
            ),
            (_PipelineSchedule, ("_maybe_compute_loss",), 1),
            (stage_compute.StageCompute, ("forward", "backward", "backward_input", "backward_weight"), 1),
            (p2p.Mailbox, ("take",), -1),
        ):
            for name in names:
                setattr(owner, name, self._timed(getattr(owner, name), sign))

    def _timed(self, method, sign: int):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += sign * (time.perf_counter() - start)

        return timed

    def reset(self) -> None:
        self.seconds = 0.0


class _Engines:
    """The four pipelined trainers of one rank and the one-process reference, each a step function."""

    def __init__(self, args):
        self.args = args
        pp, m = args.pp, args.microbatches
        layout = mesh3d.build_mesh(pp=pp, dp=1, tp=1)
        self.rank = layout.rank
        model = _model(args)
        self.steps = {}
        for schedule in TORCH_SCHEDULES:
            pm = mesh3d.parallelize(
                copy.deepcopy(model),
                layout,
                schedule=schedule,
                microbatches=m,
                virtual_stages=2,
                layers_per_stage=[args.layers // (2 * pp)] * (2 * pp),
                loss_fn=_cross_entropy,
            )
            self.steps[f"mesh3d {schedule}"] = (pm.step, list(pm.parameters()))  # a list: cleared every step
            stages = [
                PipelineStage(_torch_stage(model, s, 2 * pp), s, 2 * pp, torch.device("cpu"), group=layout.group("pp"))
                for s in _stage_indices(schedule, pp, layout.pp_rank)
            ]
            runner = TORCH_SCHEDULES[schedule](stages, n_microbatches=m, loss_fn=_cross_entropy, scale_grads=True)
            self.steps[f"torch {schedule}"] = (
                self._torch_step(runner, stages),
                [p for s in stages for p in s.submod.parameters()],
            )
        self.whole = model

    def _torch_step(self, runner, stages):
        last = any(stage.is_last for stage in stages)

        def step(tokens, targets):
            losses = []
            runner.step(tokens, target=targets, losses=losses)
            return torch.stack(losses).mean() if last else None

        return step

    def one_process(self, tokens, targets, microbatches: int = 1) -> float:
        """The whole model on rank 0, fwd + bwd of the whole batch (in `microbatches` pieces with
        gradient accumulation), timed on that rank."""
        dist.barrier()
        seconds = 0.0
        if self.rank == 0:
            start = time.perf_counter()
            for piece, target in zip(tokens.chunk(microbatches), targets.chunk(microbatches)):
                (_cross_entropy(self.whole(piece), target) / microbatches).backward()
            seconds = time.perf_counter() - start
            self.whole.zero_grad(set_to_none=True)
        dist.barrier()
        return seconds


def _bench(args):
    torch.set_num_threads(1)
    clock = _ComputeClock()
    engines = _Engines(args)
    generator = torch.Generator().manual_seed(1)
    times = {name: [] for name in [*engines.steps, "one process", "one process, microbatched"]}
    compute = {name: [] for name in engines.steps}
    losses = {name: [] for name in engines.steps}
    meters = {name: SavedBytesMeter() for name in engines.steps}  # fed in the last round only
    for step_index in range(args.steps + 2):  # the first round warms up, the last is metered (both untimed)
        timed, metered = 0 < step_index <= args.steps, step_index == args.steps + 1
        tokens = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        names = list(engines.steps)
        for name in names[step_index % len(names) :] + names[: step_index % len(names)]:
            step, params = engines.steps[name]
            dist.barrier()
            clock.reset()
            start = time.perf_counter()
            if metered:
                with torch.autograd.graph.saved_tensors_hooks(meters[name].pack, meters[name].unpack):
                    loss = step(inputs, targets)
            else:
                loss = step(inputs, targets)
            dist.barrier()
            elapsed = time.perf_counter() - start
            for p in params:
                p.grad = None
            if timed:
                times[name].append(elapsed)
                compute[name].append(clock.seconds)
            if loss is not None:
                losses[name].append(float(loss))
        if metered:
            continue
        seconds = engines.one_process(inputs, targets)
        microbatched = engines.one_process(inputs, targets, args.microbatches)
        if timed:
            times["one process"].append(seconds)
            times["one process, microbatched"].append(microbatched)
    saved = {name: meter.peak for name, meter in meters.items()}
    return {name: statistics.median(t) for name, t in times.items()}, losses, times, compute, saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if args.layers % (2 * args.pp):
        parser.error(f"--layers={args.layers} must be a multiple of 2 * pp = {2 * args.pp} (two stages per rank)")
    per_rank = run_on_ranks(_bench, args.pp, args, timeout=3600)
    medians = per_rank[0][0]
    # Per step: step time less the busiest rank's compute in that step; medians of both.
    busiest = {
        name: [max(rank[3][name][i] for rank in per_rank) for i in range(len(per_rank[0][2][name]))]
        for name in per_rank[0][3]
    }
    rest = {name: statistics.median(t - c for t, c in zip(per_rank[0][2][name], busiest[name])) for name in busiest}
    compute = {name: [statistics.median(rank[3][name]) for rank in per_rank] for name in busiest}
    losses = {name: values for rank_losses in per_rank for name, values in rank_losses[1].items() if values}
    whole = medians.pop("one process")
    microbatched = medians.pop("one process, microbatched")
    print(
        f"model: dim {args.dim}, {args.layers} layers, batch {args.batch} x {args.seq_len} tokens, "
        f"pp={args.pp}, {args.microbatches} microbatches, gloo on CPU, one thread per rank"
    )
    print(
        f"one process, whole batch, one thread: {whole * 1e3:.1f} ms "
        f"(limit for pp={args.pp}: {whole / args.pp * 1e3:.1f} ms)"
    )
    print(
        f"one process, the same {args.microbatches} microbatches one after another: {microbatched * 1e3:.1f} ms "
        f"(limit for pp={args.pp}: {microbatched / args.pp * 1e3:.1f} ms)"
    )
    for name, seconds in medians.items():
        print(
            f"{name:>26}: step {seconds * 1e3:7.1f} ms, efficiency {whole / args.pp / seconds:.3f} "
            f"(against the microbatched run: {microbatched / args.pp / seconds:.3f}), "
            f"first losses {[round(v, 5) for v in losses.get(name, [])[:2]]}"
        )
        print(
            f"{'':>28}compute per rank {[round(c * 1e3, 1) for c in compute[name]]} ms, "
            f"rest of the step {rest[name] * 1e3:.1f} ms ({rest[name] / seconds:.1%})"
        )
        print(f"{'':>28}peak saved activations MiB per rank {[round(rank[4][name] / 2**20, 2) for rank in per_rank]}")
    best = {side: min((s, n) for n, s in medians.items() if n.startswith(side)) for side in ("mesh3d", "torch")}
    print(
        f"best: mesh3d {best['mesh3d'][1]} {best['mesh3d'][0] * 1e3:.1f} ms, torch {best['torch'][1]} "
        f"{best['torch'][0] * 1e3:.1f} ms, ratio {best['mesh3d'][0] / best['torch'][0]:.3f}"
    )


if __name__ == "__main__":
    main()
