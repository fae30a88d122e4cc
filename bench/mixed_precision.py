"""Step time and pipeline traffic of fp32 against bf16 mixed precision, for one (pp, dp, tp) layout.

    torchrun --standalone --nproc-per-node 4 bench/mixed_precision.py --pp 2 --dp 1 --tp 2
    torchrun --standalone --nproc-per-node 8 bench/mixed_precision.py --pp 2 --dp 2 --tp 2

Builds the model twice, fp32 (param_dtype=None) and bf16 (param_dtype=torch.bfloat16: bf16
compute, fp32 parameters and gradient reduction, bf16 across stage boundaries), runs --warmup
training steps of each (pm.step with the default loss, AdamW), then times --steps more, each
between barriers (so a step is the slowest rank's); the two take turns step by step on the same
batches. Rank 0 prints the median step time, tokens/s, the last loss, and the pipeline P2P bytes
and messages sent per step summed over every rank, with the bf16/fp32 ratios. The bytes ratio is
exactly 1/2 whatever the machine; the time ratio depends on the hardware's bf16 support (and on a
machine with fewer cores than ranks, on contention).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from checkpoint_io import _timed  # noqa: E402

import mesh3d  # noqa: E402
from examples.llama.config import CONFIGS, get_config  # noqa: E402
from examples.llama.model import Transformer, count_parameters  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def _build(args, layout, param_dtype):
    with torch.device("meta"):
        model = Transformer(get_config(args.config, max_seq_len=args.seq_len))
    pm = mesh3d.parallelize(
        model,
        layout,
        schedule=args.schedule,
        microbatches=args.microbatches or 2 * layout.pp,
        param_dtype=param_dtype,
    )
    return model, pm, torch.optim.AdamW(pm.parameters(), lr=1e-3)


def _bench(args, layout) -> dict:
    """Per dtype: median step seconds, last loss, and the P2P traffic of one step summed over ranks.

    The dtypes take turns step by step on the same batch, so a burst of other load on the
    machine slows both rather than whichever happened to be running.
    """
    runs = {name: _build(args, layout, dtype) for name, dtype in DTYPES.items()}
    generator = torch.Generator().manual_seed(0)
    share = slice(
        layout.dp_rank * args.global_batch // layout.dp, (layout.dp_rank + 1) * args.global_batch // layout.dp
    )
    times = {name: [] for name in runs}
    losses = {}

    def step(name, tokens):
        _, pm, optimizer = runs[name]
        losses[name] = pm.step(tokens[:, :-1], tokens[:, 1:]).item()
        optimizer.step()
        optimizer.zero_grad()

    vocab = next(iter(runs.values()))[0].args.vocab_size
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(0, vocab, (args.global_batch, args.seq_len + 1), generator=generator)[share]
        for name in runs:
            seconds = _timed(layout, functools.partial(step, name, tokens))
            if i >= args.warmup:
                times[name].append(seconds)
    results = {}
    for name, (model, pm, _) in runs.items():
        c = pm.counters  # of the last step; every step sends the same
        traffic = torch.tensor(
            [c.bytes_sent, c.bytes_received, c.messages_sent], dtype=torch.int64, device=layout.device
        )
        dist.all_reduce(traffic)
        sent, received, messages = traffic.tolist()
        results[name] = {
            "step": statistics.median(times[name]),
            "loss": losses[name],
            "sent": sent,
            "received": received,
            "messages": messages,
            "params": count_parameters(model),
        }
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=-1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--config", default="debug", choices=sorted(CONFIGS))
    p.add_argument("--steps", type=int, default=5, help="timed steps per dtype")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per dtype before them")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--schedule", default="interleaved_1f1b", choices=sorted(mesh3d.pipeline.SCHEDULES))
    p.add_argument("--microbatches", type=int, default=None, help="per step and dp rank (default: 2 * pp)")
    args = p.parse_args()
    torch.set_num_threads(1)

    layout = mesh3d.build_mesh(pp=args.pp, dp=args.dp, tp=args.tp)
    if args.global_batch % layout.dp:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by dp={layout.dp}")
    results = _bench(args, layout)

    if layout.rank == 0:
        fp32 = results["fp32"]
        tokens = args.global_batch * args.seq_len
        mib = 2**20
        print(
            f"{layout}\nmodel {args.config} ({fp32['params'] / 1e6:.2f}M parameters), {args.schedule}, "
            f"microbatches {args.microbatches or 2 * layout.pp}, "
            f"global batch {args.global_batch} x {args.seq_len} tokens, "
            f"{layout.backend} on {layout.device.type}, median of {args.steps} steps after {args.warmup} warm-up"
        )
        print(
            "| dtype | step ms | tokens/s | loss (last step) | p2p sent/step, all ranks | messages "
            "| time vs fp32 | bytes vs fp32 |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, r in results.items():
            assert r["sent"] == r["received"], f"{name}: {r['sent']} bytes sent but {r['received']} received"
            print(
                f"| {name} | {r['step'] * 1000:.0f} | {tokens / r['step']:,.0f} | {r['loss']:.4f} | "
                f"{r['sent'] / mib:.3f} MiB ({r['sent']:,} B) | {r['messages']} | {r['step'] / fp32['step']:.3f} | "
                f"{r['sent'] / fp32['sent'] if fp32['sent'] else float('nan'):.4f} |",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
