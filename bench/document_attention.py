"""Block-causal attention over packed documents: SDPA with a dense mask against flex_attention.

    python bench/document_attention.py                   # on the GPU: bf16, B 4, 32 heads x 64, seq 2048
    python bench/document_attention.py --device cpu --seq-len 256 --batch 1 --heads 4

Times forward + backward of one attention call (median of --steps after --warmup), for:
causal SDPA with no documents (the floor), SDPA with the example's dense (batch, 1, seq, seq) bool
block-causal mask (examples/llama/attention.py), and flex_attention (compiled) with a BlockMask of the
same documents; and how far flex's output and input gradients are from SDPA's, in fp32. Documents
are drawn with lengths uniform in [--min-doc, --max-doc]. flex_attention has no backward on CPU
(torch 2.13): there only the SDPA rows are timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.llama.attention import block_causal_mask  # noqa: E402


def documents(batch: int, seq: int, low: int, high: int, generator: torch.Generator) -> torch.Tensor:
    rows = []
    for _ in range(batch):
        ids, doc = [], 0
        while len(ids) < seq:
            ids += [doc] * int(torch.randint(low, high + 1, (1,), generator=generator))
            doc += 1
        rows.append(ids[:seq])
    return torch.tensor(rows)


def timed(fn, steps: int, warmup: int, device: str) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--min-doc", type=int, default=64)
    p.add_argument("--max-doc", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    docs = documents(args.batch, args.seq_len, args.min_doc, args.max_doc, generator).to(device)
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    q, k, v = (torch.randn(shape, generator=generator).to(device, dtype).requires_grad_() for _ in range(3))
    mask = block_causal_mask(docs)  # (batch, 1, seq, seq) bool
    print(
        f"{device} {torch.__version__} {dtype}: batch {args.batch}, {args.heads} heads x {args.head_dim}, "
        f"seq {args.seq_len}, {int(docs.max(dim=1).values.float().mean()) + 1} documents a row on average"
    )

    def run(attend):
        def step():
            out = attend(q, k, v)
            out.sum().backward()

        return step

    rows = {
        "sdpa causal, no documents": run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "sdpa, dense block-causal mask": run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
    }
    if device == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def same_document_causal(b, h, q_idx, kv_idx):
            return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

        block_mask = create_block_mask(
            same_document_causal, args.batch, None, args.seq_len, args.seq_len, device=device
        )
        flex = torch.compile(flex_attention)
        rows["flex_attention, BlockMask"] = run(lambda q, k, v: flex(q, k, v, block_mask=block_mask))
        exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
        outputs, grads = [], []
        for attend in (
            lambda *t: F.scaled_dot_product_attention(*t, attn_mask=mask),
            lambda *t: flex(*t, block_mask=block_mask),
        ):
            out = attend(*exact)
            grads.append(torch.autograd.grad(out.square().sum(), exact))
            outputs.append(out.detach())
        error = max(
            [((outputs[1] - outputs[0]).norm() / outputs[0].norm()).item()]
            + [((a - b).norm() / b.norm()).item() for a, b in zip(grads[1], grads[0])]
        )
        print(f"flex against sdpa, fp32: relative difference {error:.1e} (output and input gradients)")
    for name, step in rows.items():
        print(f"{name:32s} {1e3 * timed(step, args.steps, args.warmup, device):8.2f} ms forward + backward")


if __name__ == "__main__":
    main()
