"""Step time and per-rank memory of the LLaMA debug config under several (pp, dp, tp) layouts (gloo, CPU).

    python bench/parallel_step.py --world 8 --layouts 8,1,1 1,8,1 1,1,8 2,2,2 --steps 5
    python bench/parallel_step.py --world 4 --layouts 2,2,1 2,1,2 --activation-checkpoint always --predict

For each layout (FSDP unless the layout ends in ",ddp"; --schedule, default interleaved 1F1B, with
--microbatches, default 2*pp) prints the median step time, tokens/s, and, as the max over ranks:
the bytes of parameters, gradients and AdamW state a rank holds (local shards), the peak bytes
autograd saved for backward (mesh3d.planner.measure.meters.SavedBytesMeter, the planner's own meter:
distinct storages, parameters not counted), the peak bytes of weight versions kept and the P2P
bytes sent per step. With --predict, the row below each layout is what mesh3d.plan predicts for
the fullest rank of that same layout (every choice pinned, fp32 as the run). On a machine with
fewer cores than ranks the times measure contention; the memory and traffic figures do not depend
on it.

    python bench/parallel_step.py --world 2 --layouts 2,1,1 --schedule pipedream_2bw --steps 3

The never-drain schedules ("pipedream", "pipedream_2bw") take the optimizer at parallelize
(`optimizer=`, AdamW at the same settings) and update inside `pm.step`, so their run has no
gradient clipping and ends with `pm.flush()` (untimed; its backwards count to the activations).
For them "versions" is the peak over the run of `pm._runtime.never_drain.versions.kept_bytes()` (the copies of
earlier weight versions this rank keeps besides its parameters; sampled after every `pm.step` and
after the flush), printed per rank below the layout's row; 0 for every other schedule. Their
gradients are consumed by each update inside the call, so the bytes in `.grad` are sampled after
every action of the run (peak), not after the step.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from multiprocess import run_on_ranks  # noqa: E402

import mesh3d  # noqa: E402
from examples.llama.config import get_config  # noqa: E402
from examples.llama.model import Transformer, loss_fn  # noqa: E402
from mesh3d.distributed.shards import local_tensor  # noqa: E402
from mesh3d.pipeline import activation_checkpoint, stage_compute  # noqa: E402
from mesh3d.pipeline.schedule.catalog import default_virtual_stages  # noqa: E402
from mesh3d.pipeline.schedule.never_drain import NEVER_DRAIN  # noqa: E402
from mesh3d.planner.measure.meters import SavedBytesMeter  # noqa: E402

MIB = 2**20


class Case(NamedTuple):
    """One layout as parallelize runs it."""

    pp: int
    dp: int
    tp: int
    dp_mode: str = "fsdp"
    schedule: str = "interleaved_1f1b"
    microbatches: int | None = None  # None: 2*pp
    activation_checkpoint: str = "never"
    tie_embeddings: bool = False

    @property
    def m(self) -> int:
        return self.microbatches or 2 * self.pp

    def virtual_stages(self, n_layers: int) -> int:
        return default_virtual_stages(self.schedule, self.pp, n_layers)

    @property
    def never_drains(self) -> bool:
        """Whether the schedule updates inside the pipeline (optimizer at parallelize, a flush at the end)."""
        return self.schedule in NEVER_DRAIN


class Measured(NamedTuple):
    """One rank's figures for one case (bytes; seconds)."""

    step_seconds: float
    parameters: int
    gradients: int
    optimizer: int
    activations: int  # peak bytes kept for backward (kept_between_actions under "selective")
    weight_versions: int  # peak bytes of kept weight versions (never-drain schedules; 0 otherwise)
    p2p_sent: int
    pp_rank: int


def _local_bytes(tensors) -> int:
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors if t is not None)


def debug_model(seq_len: int, **overrides) -> torch.nn.Module:
    with torch.device("meta"):
        return Transformer(get_config("debug", max_seq_len=seq_len, **overrides))


def _held_outside_autograd(step, meter: SavedBytesMeter, block_caches=()) -> int:
    """Bytes a "selective" step keeps for its backwards that autograd's hooks do not see: the
    results cached by torch's selective checkpointing (each cache's `.storage`: {op: {index: a tree
    of _VersionWrapper, or a sentinel}}) and the stage inputs `saved` for a recompute (saved[key] =
    (x, None)); as distinct storages, those the meter already counts left out."""
    storages: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            storage = local_tensor(t).untyped_storage()
            if storage._cdata not in meter._refs:
                storages[storage._cdata] = storage.nbytes()

    for cache in [*step.selective_caches.values(), *block_caches]:
        for results in cache.storage.values():
            for entry in results.values():
                for leaf in torch.utils._pytree.tree_leaves(entry):
                    add(getattr(leaf, "val", None))  # sentinels (_RECOMPUTE, _CONSUMED) hold nothing
    for x, out in step.saved.values():
        if out is None:  # to be recomputed: the input is what stays (token ids: the whole batch's storage)
            add(x)
    return sum(storages.values())


@contextlib.contextmanager
def kept_between_actions(meter: SavedBytesMeter, after_action: Callable[[], None] | None = None):
    """The peak, over the moments between a training step's actions, of what the rank keeps for its
    backwards: the meter's live bytes plus what `_held_outside_autograd` finds in the interpreter.

    Under "selective" the forward's graph is dropped (autograd's hooks see nothing of it) and the
    stage is rebuilt inside its backward action; the meter's own peak is that rebuild, while what
    stays from a forward to its backward is the input and the cache. Yields a one-element list that
    holds the peak; wraps `StageCompute.execute` for the duration (this process only).
    `after_action`, if given, runs after each training action too (another figure sampled there)."""
    execute = stage_compute.StageCompute.execute
    contexts = activation_checkpoint.selective_contexts
    block_caches = weakref.WeakSet()  # the caches of blocks checkpointed one by one, while torch holds them
    peak = [0]

    def sampled(step, action, is_last_backward):
        execute(step, action, is_last_backward)
        if step.train:
            peak[0] = max(peak[0], meter.now + _held_outside_autograd(step, meter, list(block_caches)))
            if after_action is not None:
                after_action()

    def recorded_contexts():
        caching, cached = contexts()
        block_caches.add(cached)
        return caching, cached

    stage_compute.StageCompute.execute = sampled
    activation_checkpoint.selective_contexts = recorded_contexts
    try:
        yield peak
    finally:
        stage_compute.StageCompute.execute = execute
        activation_checkpoint.selective_contexts = contexts


def measure(
    cases: dict[str, Case],
    batch: int,
    seq_len: int,
    steps: int,
    model_overrides: dict | None = None,
) -> dict[str, Measured]:
    """On each rank: run `steps` + 1 AdamW steps (the first warms up) of each case; this rank's figures.
    A never-drain case's optimizer runs inside `pm.step`, and a flush ends its run."""
    torch.set_num_threads(1)
    return {name: _measure_case(case, batch, seq_len, steps, model_overrides) for name, case in cases.items()}


def _measure_case(case: Case, batch: int, seq_len: int, steps: int, model_overrides: dict | None) -> Measured:
    layout = mesh3d.build_mesh(pp=case.pp, dp=case.dp, tp=case.tp)
    model = debug_model(seq_len, tie_embeddings=case.tie_embeddings, **(model_overrides or {}))
    inside = functools.partial(torch.optim.AdamW, lr=1e-3) if case.never_drains else None
    pm = mesh3d.parallelize(
        model,
        layout,
        schedule=case.schedule,
        microbatches=case.m,
        loss_fn=loss_fn,
        dp_mode=case.dp_mode,
        activation_checkpoint=case.activation_checkpoint,
        optimizer=inside,
    )
    optimizer = pm.optimizer if case.never_drains else torch.optim.AdamW(pm.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    times, meter, kept_peak, grads, versions = [], SavedBytesMeter(), 0, 0, 0

    def sample_grads() -> None:  # never-drain: each update consumes its gradients within the call
        nonlocal grads
        grads = max(grads, _local_bytes(p.grad for p in pm.parameters()))

    def metered(run: Callable, *args) -> None:
        nonlocal kept_peak
        with (
            torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack),
            kept_between_actions(meter, sample_grads if case.never_drains else None) as kept,
        ):
            run(*args)
        kept_peak = max(kept_peak, kept[0])

    def kept_versions() -> int:
        return pm._runtime.never_drain.versions.kept_bytes() if pm._runtime.never_drain is not None else 0

    share = batch // case.dp
    for _ in range(steps + 1):
        tokens = torch.randint(0, 256, (batch, seq_len + 1), generator=generator)
        # the rank's own share, as its loader gives it (a view would keep the global batch alive)
        tokens = tokens[layout.dp_rank * share : (layout.dp_rank + 1) * share].clone()
        start = time.perf_counter()
        # contiguous, as a copy to the device makes them (a view would keep seq_len + 1 ids a row)
        metered(pm.step, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        if case.never_drains:
            versions = max(versions, kept_versions())
        else:
            pm.clip_grad_norm_(1.0)
            optimizer.step()
            grads = _local_bytes(p.grad for p in pm.parameters())  # before zero_grad
            optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    p2p_sent = pm.counters.bytes_sent  # the last call's (a flush's traffic would count to it)
    if case.never_drains:
        metered(pm.flush)  # the backwards and updates still in flight
        versions = max(versions, kept_versions())
    params = _local_bytes(pm.parameters())
    adam = _local_bytes(
        t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    step = statistics.median(times[1:]) if steps else times[0]
    activations = kept_peak if case.activation_checkpoint == "selective" else meter.peak
    return Measured(step, params, grads, adam, activations, versions, p2p_sent, layout.pp_rank)


def predict(case: Case, world: int, batch: int, seq_len: int, model_overrides: dict | None = None):
    """mesh3d.plan's Plan for `case` (every choice pinned, fp32): .memory_per_rank is its fullest
    rank's MemoryBreakdown, .memory_by_pp_rank each pp rank's."""
    model = debug_model(seq_len, tie_embeddings=case.tie_embeddings, **(model_overrides or {}))
    fix = dict(
        pp=case.pp,
        dp=case.dp,
        tp=case.tp,
        dp_mode=case.dp_mode,
        schedule=case.schedule,
        virtual_stages=case.virtual_stages(len(model.layers)),
        microbatches=case.m,
        activation_checkpoint=case.activation_checkpoint,
        param_dtype=None,
        compile=False,
    )
    plans = mesh3d.plan(
        model,
        gpus=world,
        gpus_per_node=world,
        hardware="h100",
        seq_len=seq_len,
        global_batch=batch,
        fix=fix,
        memory_limit=2**60,
    )
    return plans[0]


def worst(per_rank: list[dict[str, Measured]], name: str, pp_rank: int | None = None) -> Measured:
    """The max over ranks (those of pipeline rank `pp_rank`, if given) of each figure."""
    ranks = [r[name] for r in per_rank if pp_rank is None or r[name].pp_rank == pp_rank]
    return Measured(*(max(r[k] for r in ranks) for k in range(len(Measured._fields))))


def parse_layout(text: str, args) -> Case:
    parts = text.split(",")
    pp, dp, tp = (int(p) for p in parts[:3])
    return Case(
        pp, dp, tp, parts[3] if len(parts) > 3 else "fsdp", args.schedule, args.microbatches, args.activation_checkpoint
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--layouts", nargs="+", default=["8,1,1", "1,8,1", "1,8,1,ddp", "1,1,8", "2,2,2", "4,1,2"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedule", default="interleaved_1f1b")
    parser.add_argument("--microbatches", type=int, default=None, help="default 2*pp")
    parser.add_argument("--activation-checkpoint", default="never")
    parser.add_argument("--predict", action="store_true", help="also print mesh3d.plan's prediction per layout")
    args = parser.parse_args()
    if args.predict and args.schedule in NEVER_DRAIN:
        parser.error(
            f"--predict: mesh3d.plan does not model the never-drain schedules ({args.schedule}); "
            "drop --predict or choose a schedule that drains"
        )
    cases = {text: parse_layout(text, args) for text in args.layouts}
    for text, case in cases.items():
        if case.pp * case.dp * case.tp != args.world:
            raise SystemExit(f"layout {text}: pp*dp*tp={case.pp * case.dp * case.tp} is not --world {args.world}")
    # before the ranks start: planning at tp > 1 needs a process without a process group
    predicted = (
        {text: predict(c, args.world, args.batch, args.seq_len) for text, c in cases.items()} if args.predict else {}
    )
    per_rank = run_on_ranks(measure, args.world, cases, args.batch, args.seq_len, args.steps, timeout=3600)
    tokens = args.batch * args.seq_len
    m = "2*pp" if args.microbatches is None else args.microbatches
    print(
        f"debug config, {args.world} ranks, global batch {args.batch} x {args.seq_len} tokens, FSDP unless noted, "
        f"{args.schedule} with microbatches = {m}, activation_checkpoint={args.activation_checkpoint}, gloo on CPU; "
        "memory figures: max over ranks, MiB"
    )
    print("layout (pp,dp,tp)  step ms  tokens/s  params  grads  adam  saved-activations  versions  p2p-sent/step")
    for name, case in cases.items():
        got = worst(per_rank, name)
        print(
            f"{name:>17}  {got.step_seconds * 1000:7.0f}  {tokens / got.step_seconds:8,.0f}  "
            f"{got.parameters / MIB:6.3f}  {got.gradients / MIB:5.3f}  {got.optimizer / MIB:5.3f}  "
            f"{got.activations / MIB:17.3f}  {got.weight_versions / MIB:8.3f}  {got.p2p_sent / MIB:13.2f}"
        )
        if case.never_drains:
            kept = ", ".join(f"{r[name].weight_versions / MIB:.3f}" for r in per_rank)
            pp_ranks = ", ".join(str(r[name].pp_rank) for r in per_rank)
            print(f"{'':>17}  weight versions kept, peak MiB per rank: [{kept}] (pp ranks [{pp_ranks}])")
        if name in predicted:
            p = predicted[name].memory_per_rank
            print(
                f"{'predicted':>17}  {'':7}  {'':8}  {p.parameters / MIB:6.3f}  {p.gradients / MIB:5.3f}  "
                f"{p.optimizer / MIB:5.3f}  {p.activations / MIB:17.3f}"
            )


if __name__ == "__main__":
    main()
