"""One context-parallel rank's attention, timed: what the planner charges at the matmuls' rate.

    python bench/cp_attention.py                     # Llama 3 8B's attention, 32k..262k tokens over cp = 1..8, bf16
    python bench/cp_attention.py --device cpu --dtype float32 --heads 4 --kv-heads 2 --head-dim 16 --seq 512 --cp 2

A cp rank attends its head and tail chunks over the whole sequence's keys
(mesh3d/context_parallel/attention.py): forward, then in backward the forward again and its
gradients. This runs those calls for cp rank 0 (every rank attends as many pairs) in one process,
the gathered K and V made up, no collectives: what is left is the attention's own kernels, on the
GPU the flash kernel under a lower-right causal bias (lower_right_causal.py). Prints per (seq, cp)
the milliseconds per layer (median of --repeats after a warm-up), the FLOPs as the planner counts
them (planner/measure/context_parallel.py: half the score matrix; forward, its rerun, backward)
and the rate reached, beside the planner's eager matmul rate for the device (`--hardware`: peak x
the fitted fraction). docs/plan.md#context-parallelism-against-torchtitan holds the planner's
cp predictions that this measures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils import flop_counter  # noqa: E402

from mesh3d.context_parallel.attention import CausalQueries, GatheredAttention, _blocks_of  # noqa: E402
from mesh3d.context_parallel.call_verdicts import CAUSAL  # noqa: E402
from mesh3d.context_parallel.lower_right_causal import lower_right_causal  # noqa: E402
from mesh3d.context_parallel.sequence_cut import SequenceCut  # noqa: E402
from mesh3d.planner.hardware import HARDWARE  # noqa: E402


def rank_attention(q, k_all, v_all, grad_out, rows, backward: bool) -> None:
    """attention.py's causal forward (or, with `backward`, its backward: the forward again, then
    the gradients) over the rows (start, stop, keys) of one rank's queries."""
    if not backward:
        with torch.no_grad():
            torch.cat(
                [
                    lower_right_causal(q[..., a:b, :], k_all[..., :n, :], v_all[..., :n, :], None, True)
                    for a, b, n in rows
                ],
                -2,
            )
        return
    for a, b, n in rows:
        q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q[..., a:b, :], k_all[..., :n, :], v_all[..., :n, :]))
        out = lower_right_causal(q_, k_, v_, None, True)
        torch.autograd.grad(out, (q_, k_, v_), grad_out[..., a:b, :])


def measure(seq: int, cp: int, heads: int, kv_heads: int, head_dim: int, dtype, device, repeats: int) -> dict:
    """One (seq, cp): the rank's forward and backward milliseconds, and the FLOPs the planner counts."""
    cut = SequenceCut(cp, 0, seq)
    local = 2 * cut.chunk
    q = torch.randn(1, heads, local, head_dim, dtype=dtype, device=device)
    k_all, v_all = (torch.randn(1, kv_heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
    grad_out = torch.randn_like(q)
    causal = CausalQueries.of(cut.positions, cut.gathered_positions)
    call = GatheredAttention(None, cp, lambda _: None, None, True, CAUSAL, lambda _: None, causal)
    rows = _blocks_of(call, q, k_all[..., :local, :], v_all[..., :local, :]).rows

    def timed(backward: bool) -> float:
        times = []
        for i in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            rank_attention(q, k_all, v_all, grad_out, rows, backward)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first: warm-up
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    forward_ms, backward_ms = timed(False), timed(True)
    keys = (seq + 1) // 2  # as the planner's probe charges a causal call
    kn = (1, heads, keys, head_dim)
    forward = flop_counter.sdpa_flop_count(q.shape, kn, kn)
    backward = flop_counter.sdpa_backward_flop_count(q.shape, q.shape, kn, kn)
    return {"calls": len(rows), "forward_ms": forward_ms, "backward_ms": backward_ms, "flops": 2 * forward + backward}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 65536, 131072, 262144])
    parser.add_argument("--cp", type=int, nargs="+", default=None, help="one per --seq (default: 32k tokens a rank)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hardware", default=None, help="the planner's preset to compare with (h100, h200, a100-80gb)")
    args = parser.parse_args(argv)
    cps = args.cp or [max(1, s // 32768) for s in args.seq]
    if len(cps) != len(args.seq):
        parser.error(f"--cp takes one degree per --seq: {len(args.seq)} lengths, {len(cps)} degrees")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    name = args.hardware
    if name is None and device.type == "cuda":
        gpu = torch.cuda.get_device_name()
        name = "h200" if "H200" in gpu else "h100" if "H100" in gpu else "a100-80gb" if "A100" in gpu else None
    hardware = HARDWARE.get(name) if name else None
    charged = hardware.peak_flops * hardware.achievable_fraction / 1e12 if hardware else None
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {args.dtype}, "
        f"{args.heads} heads ({args.kv_heads} K/V) of {args.head_dim}; one layer of cp rank 0"
    )
    if charged:
        print(f"the planner's eager matmul rate on {name}: {charged:.0f} TFLOP/s")
    print("| seq | cp | calls | forward ms | backward ms | planner's TFLOP | TFLOP/s | vs planner's rate |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for seq, cp in zip(args.seq, cps, strict=True):
        r = measure(seq, cp, args.heads, args.kv_heads, args.head_dim, dtype, device, args.repeats)
        seconds = (r["forward_ms"] + r["backward_ms"]) / 1e3  # the backward holds the forward's rerun
        rate = r["flops"] / seconds / 1e12
        versus = f"{rate / charged:.2f}" if charged else "-"
        print(
            f"| {seq:,} | {cp} | {r['calls']} | {r['forward_ms']:.1f} | {r['backward_ms']:.1f} | "
            f"{r['flops'] / 1e12:.1f} | {rate:.0f} | {versus} |"
        )


if __name__ == "__main__":
    main()
