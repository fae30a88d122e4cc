"""What the bad-data check costs: the local check, the agreement all-reduce, and pm.step with and without it.

    python bench/batch_check.py                                              # the local check only
    torchrun --standalone --nproc-per-node 4 bench/batch_check.py --pp 2 --dp 2 --steps 20

The local check (mesh3d/step/batch_check.py: dtype, shape, min/max of ids and targets against the
vocabulary) is timed on batches of a few sizes. Under torchrun, the agreement (one all-reduce
of one int32 flag over the world) is timed alone, and pm.step of the LLaMA `debug` config is
timed with the check and with it replaced by a no-op (the same steps, alternating, so that
drift affects both alike). Rank 0 prints medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mesh3d  # noqa: E402
import mesh3d.parallel_model  # noqa: E402
from examples.llama.config import get_config  # noqa: E402
from examples.llama.model import Transformer, loss_fn  # noqa: E402
from mesh3d.step.batch_check import agree_on_batch, batch_problem, batch_verdict  # noqa: E402


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def local_check(vocab: int = 32000) -> None:
    for batch, seq in ((16, 128), (8, 2048), (32, 4096)):
        inputs = torch.randint(0, vocab, (batch, seq))
        targets = torch.randint(0, vocab, (batch, seq))
        seconds = _median_s(lambda: batch_problem(inputs, targets, vocab), 50)
        print(f"local check, batch {batch} x {seq} tokens (int64, CPU): {seconds * 1e6:8.1f} us", flush=True)


def step_with_and_without(args) -> None:
    layout = mesh3d.build_mesh(pp=args.pp, dp=args.dp, tp=args.tp)
    flag_s = _median_s(lambda: agree_on_batch(None, "bench"), 200)
    config = get_config("debug", max_seq_len=args.seq_len)
    with torch.device("meta"):
        model = Transformer(config)
    pm = mesh3d.parallelize(model, layout, loss_fn=loss_fn)
    local = args.global_batch // layout.dp
    inputs = torch.randint(0, config.vocab_size, (local, args.seq_len))
    targets = torch.randint(0, config.vocab_size, (local, args.seq_len))
    timings = {"with the check": [], "without": []}
    for step in range(args.steps + 2):
        for name in timings:
            checking = name == "with the check"
            mesh3d.parallel_model.agree_on_batch = agree_on_batch if checking else (lambda *a: None)
            mesh3d.parallel_model.batch_verdict = batch_verdict if checking else (lambda *a: None)
            dist.barrier()
            began = time.perf_counter()
            pm.step(inputs, targets)
            pm.zero_grad()
            dist.barrier()
            if step >= 2:  # the first steps build buffers and caches
                timings[name].append(time.perf_counter() - began)
    if layout.rank == 0:
        print(
            f"{layout}\nagreement (all-reduce of one int32 flag over {layout.world_size} ranks): "
            f"{flag_s * 1e6:.0f} us median",
            flush=True,
        )
        for name, times in timings.items():
            print(
                f"pm.step {name}: {statistics.median(times) * 1e3:.1f} ms median of {len(times)} "
                f"(debug config, global batch {args.global_batch} x {args.seq_len})",
                flush=True,
            )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=-1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    if "RANK" not in os.environ:
        local_check()
        return
    step_with_and_without(args)


if __name__ == "__main__":
    main()
