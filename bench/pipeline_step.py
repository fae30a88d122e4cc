"""Time pipelined training steps of the LLaMA debug config on CPU (gloo), one schedule after another.

    python bench/pipeline_step.py --pp 4 --microbatches 8 --steps 5

Prints, per schedule: median step time, tokens/s, the simulator's bubble fraction, and per rank the
peak live activations (runtime counter) and the peak bytes of saved activations measured with
torch's saved-tensor hooks (mesh3d.planner.measure.meters.SavedBytesMeter, the planner's own meter: distinct
storages, parameters not counted; it does not see what "selective" checkpointing caches: torch keeps
that outside autograd's saved tensors). On a machine with fewer cores than ranks the times measure the CPU
contention as much as the schedule; the activation figures do not depend on it.
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
from examples.llama.config import get_config  # noqa: E402
from examples.llama.model import Transformer, loss_fn  # noqa: E402
from mesh3d.pipeline.config import ACTIVATION_CHECKPOINT_MODES  # noqa: E402
from mesh3d.planner.measure.meters import SavedBytesMeter  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]


def _bench(pp, microbatches, batch, seq_len, steps, activation_checkpoint):
    torch.set_num_threads(1)
    layout = mesh3d.build_mesh(pp=pp, dp=1, tp=1)
    results = {}
    for schedule, v in SCHEDULES:
        with torch.device("meta"):
            model = Transformer(get_config("debug", max_seq_len=seq_len))
        pm = mesh3d.parallelize(
            model,
            layout,
            schedule=schedule,
            microbatches=microbatches,
            virtual_stages=v,
            loss_fn=loss_fn,
            activation_checkpoint=activation_checkpoint,
        )
        optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(0)
        times, meter = [], SavedBytesMeter()
        for _ in range(steps + 1):  # the first step warms up
            tokens = torch.randint(0, 256, (batch, seq_len + 1), generator=generator)
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                pm.step(tokens[:, :-1], tokens[:, 1:])
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        results[schedule] = (statistics.median(times[1:]), pm.peak_live_activations, meter.peak)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--activation-checkpoint", default="never", choices=list(ACTIVATION_CHECKPOINT_MODES))
    args = parser.parse_args()
    per_rank = run_on_ranks(
        _bench,
        args.pp,
        args.pp,
        args.microbatches,
        args.batch,
        args.seq_len,
        args.steps,
        args.activation_checkpoint,
        timeout=1800,
    )
    tokens = args.batch * args.seq_len
    print(
        f"debug config, pp={args.pp}, microbatches={args.microbatches}, batch {args.batch} x {args.seq_len} tokens, "
        f"activation_checkpoint={args.activation_checkpoint}, gloo on CPU"
    )
    for schedule, v in SCHEDULES:
        step_time = max(r[schedule][0] for r in per_rank)
        bubble = mesh3d.pipeline.simulate(schedule, args.pp, args.microbatches, v).bubble_fraction
        peaks = [r[schedule][1] for r in per_rank]
        saved = [f"{r[schedule][2] / 2**20:.1f}" for r in per_rank]
        print(
            f"{schedule:>17} v={v}: step {step_time * 1000:7.1f} ms, {tokens / step_time:8,.0f} tokens/s, "
            f"simulated bubble {bubble:5.1%}, peak live activations {peaks}, peak saved MiB {saved}"
        )


if __name__ == "__main__":
    main()
