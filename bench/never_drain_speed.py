"""Steady-state time per batch of the never-drain schedules against the ones that drain, CPU (gloo).

    python bench/never_drain_speed.py --pp 2 --microbatches 4 --calls 6

Each schedule trains the LLaMA debug config for one warm-up call and then `--calls` calls (the
optimizer inside `pm.step`: `optimizer=`), timed from the end of the warm-up to the end of the last
call (a never-drain schedule's last backwards still in flight, as in a long run); then a flush.
Prints per schedule: seconds per batch, tokens/s, the simulator's time per batch in the steady
state (forward 1, backward 2, of K calls in a row), and per rank the bytes of weight versions kept
after the flush and the peak bytes of saved activations (SavedBytesMeter). On a machine with
fewer cores than ranks the times measure the CPU contention as much as the schedule.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from multiprocess import run_on_ranks  # noqa: E402

import mesh3d  # noqa: E402
from examples.llama.config import get_config  # noqa: E402
from examples.llama.model import Transformer  # noqa: E402
from mesh3d.planner.measure.meters import SavedBytesMeter  # noqa: E402

SCHEDULES = [("1f1b", 1), ("zbv", 2), ("pipedream_2bw", 1), ("pipedream", 1)]


def _bench(pp, microbatches, batch, seq_len, calls):
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
            optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
        )
        generator = torch.Generator().manual_seed(0)
        meter = SavedBytesMeter()
        start = None
        for call in range(calls + 1):
            if call == 1:
                start = time.perf_counter()
            tokens = torch.randint(0, 256, (batch, seq_len + 1), generator=generator)
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                pm.step(tokens[:, :-1], tokens[:, 1:])
        elapsed = time.perf_counter() - start
        pm.flush()
        kept = pm._runtime.never_drain.versions.kept_bytes() if pm._runtime.never_drain is not None else 0
        results[schedule] = (elapsed / calls, kept, meter.peak)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--calls", type=int, default=6)
    args = parser.parse_args()
    per_rank = run_on_ranks(
        _bench, args.pp, args.pp, args.microbatches, args.batch, args.seq_len, args.calls, timeout=1800
    )
    tokens = args.batch * args.seq_len
    print(
        f"debug config, pp={args.pp}, microbatches={args.microbatches}, batch {args.batch} x {args.seq_len} tokens, "
        f"{args.calls} calls after one warm-up, gloo on CPU"
    )
    for schedule, v in SCHEDULES:
        per_batch = max(r[schedule][0] for r in per_rank)
        # A rank's whole forward costs 1 and backward 2 whatever v (v stages of 1/v each); zbv's
        # backward splits in halves.
        steady = mesh3d.pipeline.simulate(
            schedule,
            args.pp,
            args.microbatches,
            v,
            calls=args.calls,
            f_cost=1 / v,
            b_cost=2 / v,
            w_cost=1 / v if v == 2 else 0.0,
        )
        kept = [f"{r[schedule][1] / 2**20:.1f}" for r in per_rank]
        saved = [f"{r[schedule][2] / 2**20:.1f}" for r in per_rank]
        print(
            f"  {schedule:14s} {per_batch * 1e3:7.1f} ms/batch  {tokens / per_batch:8.0f} tokens/s  "
            f"simulated {steady.makespan / args.calls:5.1f} units/batch  kept versions MiB per rank {kept}  "
            f"peak saved activations MiB per rank {saved}"
        )


if __name__ == "__main__":
    main()
