"""Step time and per-rank memory of the LLaMA debug config under several (pp, dp, tp) layouts (gloo, CPU).

    python bench/parallel_step.py --world 8 --layouts 8,1,1 1,8,1 1,1,8 2,2,2 --steps 5

For each layout (FSDP, interleaved 1F1B with microbatches = 2·pp) prints the median step time,
tokens/s, and, as the max over ranks: the bytes of parameters, gradients and AdamW state this
rank holds (local shards), the peak bytes autograd saved for backward, and the P2P bytes sent per
step. A layout written with a trailing ",ddp" runs dp_mode="ddp". On a machine with fewer cores
than ranks the times measure contention; the memory and traffic figures do not depend on it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

import torch  # noqa: E402

import mesh3d  # noqa: E402
from examples.llama.config import get_config  # noqa: E402
from examples.llama.model import Transformer, loss_fn  # noqa: E402
from mesh3d.distributed.shards import local_tensor  # noqa: E402
from multiprocess import run_on_ranks  # noqa: E402
from pipeline_step import SavedBytes  # noqa: E402


def _local_bytes(tensors) -> int:
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors if t is not None)


def _bench(layouts, batch, seq_len, steps):
    torch.set_num_threads(1)
    results = {}
    for name, (pp, dp, tp, dp_mode) in layouts.items():
        layout = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
        with torch.device("meta"):
            model = Transformer(get_config("debug", max_seq_len=seq_len))
        pm = mesh3d.parallelize(model, layout, microbatches=2 * pp, loss_fn=loss_fn, dp_mode=dp_mode)
        optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(0)
        times, meter = [], SavedBytes()
        share = batch // dp
        for _ in range(steps + 1):  # the first step warms up
            tokens = torch.randint(0, 256, (batch, seq_len + 1), generator=generator)[layout.dp_rank * share:(layout.dp_rank + 1) * share]
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                pm.step(tokens[:, :-1], tokens[:, 1:])
            pm.clip_grad_norm_(1.0)
            optimizer.step()
            state = _local_bytes(p.grad for p in pm.parameters())  # grads, before zero_grad
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        params = _local_bytes(pm.parameters())
        adam = _local_bytes(t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        results[name] = (statistics.median(times[1:]), params, state, adam, meter.peak, pm.runtime.counters.bytes_sent)
    return results


def parse_layout(text: str) -> tuple[int, int, int, str]:
    parts = text.split(",")
    pp, dp, tp = (int(p) for p in parts[:3])
    return pp, dp, tp, parts[3] if len(parts) > 3 else "fsdp"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--layouts", nargs="+", default=["8,1,1", "1,8,1", "1,8,1,ddp", "1,1,8", "2,2,2", "4,1,2"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    layouts = {text: parse_layout(text) for text in args.layouts}
    for text, (pp, dp, tp, _) in layouts.items():
        if pp * dp * tp != args.world:
            raise SystemExit(f"layout {text}: pp*dp*tp={pp * dp * tp} is not --world {args.world}")
    per_rank = run_on_ranks(_bench, args.world, layouts, args.batch, args.seq_len, args.steps, timeout=3600)
    tokens = args.batch * args.seq_len
    print(f"debug config, {args.world} ranks, global batch {args.batch} x {args.seq_len} tokens, FSDP unless noted, "
          "interleaved 1F1B with microbatches = 2*pp, gloo on CPU; memory figures: max over ranks, MiB")
    print("layout (pp,dp,tp)  step ms  tokens/s  params  grads  adam  saved-activations  p2p-sent/step")
    mib = 2**20
    for name in layouts:
        step = max(r[name][0] for r in per_rank)
        params, grads, adam, saved, sent = (max(r[name][k] for r in per_rank) for k in range(1, 6))
        print(f"{name:>17}  {step * 1000:7.0f}  {tokens / step:8,.0f}  {params / mib:6.2f}  {grads / mib:5.2f}  "
              f"{adam / mib:5.2f}  {saved / mib:17.1f}  {sent / mib:13.2f}")


if __name__ == "__main__":
    main()
