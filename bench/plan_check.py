"""The planner against this machine: predicted step time of 2-rank layouts vs measured (gloo, CPU).

    python bench/plan_check.py --steps 5

For a small LLaMA (fp32, one thread per rank) at (2,1,1) with each schedule, (1,2,1) with FSDP
and with DDP, and (1,1,2), prints the measured median and best step time (the slower rank's), the time
`mesh3d.plan(..., hardware="this-machine", fix=<that layout>)` predicts, the error, and whether
the predicted best layout is the measured best (or within 5 % of it). The machine is measured
first (mesh3d/planner/measure/machine_bench.py); run it on a quiet machine. The error is against the
best step: the planner times its parts best-of-N too, i.e. it predicts the quiet machine, and on a
shared machine the best step is the closest to that.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from multiprocess import run_on_ranks  # noqa: E402

import mesh3d  # noqa: E402
from examples.llama.config import ModelArgs  # noqa: E402
from examples.llama.model import Transformer  # noqa: E402
from mesh3d.planner.measure.machine_bench import measure_this_machine  # noqa: E402

# (name, pp, dp, tp, schedule, virtual_stages, dp_mode)
LAYOUTS = [
    ("(2,1,1) gpipe", 2, 1, 1, "gpipe", 1, "fsdp"),
    ("(2,1,1) 1f1b", 2, 1, 1, "1f1b", 1, "fsdp"),
    ("(2,1,1) interleaved_1f1b", 2, 1, 1, "interleaved_1f1b", 2, "fsdp"),
    ("(2,1,1) zero_bubble", 2, 1, 1, "zero_bubble", 1, "fsdp"),
    ("(2,1,1) zbv", 2, 1, 1, "zbv", 2, "fsdp"),
    ("(1,2,1) fsdp", 1, 2, 1, "1f1b", 1, "fsdp"),
    ("(1,2,1) ddp", 1, 2, 1, "1f1b", 1, "ddp"),
    ("(1,1,2)", 1, 1, 2, "1f1b", 1, "fsdp"),
]


def model_args(seq_len: int) -> ModelArgs:
    return ModelArgs(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=512, multiple_of=64, max_seq_len=seq_len)


def meta_model(seq_len: int) -> Transformer:
    with torch.device("meta"):
        return Transformer(model_args(seq_len))


def fix_of(layout, microbatches: int) -> dict:
    _, pp, dp, tp, schedule, v, dp_mode = layout
    return dict(
        pp=pp,
        dp=dp,
        tp=tp,
        schedule=schedule,
        virtual_stages=v,
        dp_mode=dp_mode,
        microbatches=microbatches,
        activation_checkpoint="never",
        param_dtype=None,
        compile=False,
    )


def _measure(layouts, microbatches, batch, seq_len, steps):
    torch.set_num_threads(1)
    times = {}
    for layout in layouts:
        pm = mesh3d.parallelize(meta_model(seq_len), **fix_of(layout, microbatches))
        optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(0)
        dp, dp_rank, samples = pm.layout.dp, pm.layout.dp_rank, []
        for _ in range(steps + 1):
            tokens = torch.randint(0, 512, (batch, seq_len + 1), generator=generator)
            share = tokens[dp_rank * batch // dp : (dp_rank + 1) * batch // dp]
            start = time.perf_counter()
            pm.step(share[:, :-1], share[:, 1:])
            optimizer.step()
            optimizer.zero_grad()
            samples.append(time.perf_counter() - start)
        times[layout[0]] = (statistics.median(samples[1:]), min(samples[1:]))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    machine = measure_this_machine()
    print(f"this machine: {machine.source}")
    predicted = {}
    for layout in LAYOUTS:
        plans = mesh3d.plan(
            meta_model(args.seq_len),
            gpus=2,
            gpus_per_node=2,
            hardware=machine,
            seq_len=args.seq_len,
            global_batch=args.batch,
            fix=fix_of(layout, args.microbatches),
            memory_limit="1TiB",
        )
        predicted[layout[0]] = plans[0].step_seconds
    measured, median = {}, {}
    for result in run_on_ranks(
        _measure, 2, LAYOUTS, args.microbatches, args.batch, args.seq_len, args.steps, timeout=3600
    ):
        for name, (middle, best) in result.items():
            median[name] = max(median.get(name, 0.0), middle)
            measured[name] = max(measured.get(name, 0.0), best)
    print(
        f"LLaMA dim 256, 8 layers, batch {args.batch} x {args.seq_len}, {args.microbatches} microbatches, fp32, "
        "2 ranks (gloo)"
    )
    print(f"{'layout':>26}  median s  best s  predicted s  error (vs best)")
    for name in measured:
        error = predicted[name] / measured[name] - 1
        print(f"{name:>26}  {median[name]:8.3f}  {measured[name]:6.3f}  {predicted[name]:11.3f}  {error:+6.1%}")
    best_measured = min(measured, key=measured.get)
    best_predicted = min(predicted, key=predicted.get)
    gap = measured[best_predicted] / measured[best_measured] - 1
    print(f"measured best: {best_measured}; predicted best: {best_predicted} (measured {gap:+.1%} from the best)")


if __name__ == "__main__":
    main()
