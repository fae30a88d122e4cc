"""Train a LLaMA-style model on the default corpus (the Python standard library's sources).

    python examples/llama/train.py                   # debug config, one process, CPU
    python examples/llama/train.py --steps 50 --metrics runs/debug.jsonl

AdamW, linear warmup then cosine decay, gradient clipping; a progress line every --log-every
steps and one JSON line of metrics per step. Today it runs one process (world size 1); the
pipeline/data/tensor axes plug in through mesh3d.parallelize.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

# Run as a script, the repository root is not on sys.path; the example imports itself as a package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mesh3d  # noqa: E402
from examples.llama.config import CONFIGS, get_config  # noqa: E402
from examples.llama.model import Transformer, count_parameters, loss_fn  # noqa: E402
from mesh3d.data import ByteTokenizer, DistributedLoader, TokenDataset  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="debug", choices=sorted(CONFIGS))
    p.add_argument("--n-layers", type=int, default=None, help="override the config's number of layers")
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None, help="tie embedding and output")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, all ranks together")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of the peak")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm; 0 disables clipping")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the data order")
    p.add_argument("--data", nargs="*", default=None, help="text files or directories (default: the stdlib corpus)")
    p.add_argument("--token-file", default=None, help="a pre-tokenized .npy (or raw, with --token-dtype) file")
    p.add_argument("--token-dtype", default=None)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--metrics", default="runs/train.jsonl", help="JSONL file, one line per step")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    return p.parse_args(argv)


def lr_at(step: int, *, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup from peak/warmup to peak, then cosine decay to min_ratio*peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_dataset(args) -> TokenDataset:
    if args.token_file:
        return TokenDataset.from_token_file(args.token_file, args.seq_len, dtype=args.token_dtype)
    if args.data:
        return TokenDataset.from_text_files(args.data, args.seq_len)
    return TokenDataset.from_stdlib(args.seq_len)


def build_optimizer(model: torch.nn.Module, args) -> torch.optim.AdamW:
    """AdamW; matrices decay, norm gains (1-D) do not."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def build_model(args, device: torch.device) -> Transformer:
    overrides = {"max_seq_len": max(args.seq_len, 1)}
    if args.n_layers is not None:
        overrides["n_layers"] = args.n_layers
    if args.tied is not None:
        overrides["tie_embeddings"] = args.tied
    config = get_config(args.config, **overrides)
    if not args.token_file and config.vocab_size < ByteTokenizer.vocab_size:
        raise SystemExit(
            f"config {args.config} has vocab_size={config.vocab_size}, fewer than the byte tokenizer's "
            f"{ByteTokenizer.vocab_size}; train it on a --token-file of its own vocabulary"
        )
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device=device)
    model.init_weights(seed=args.seed)
    return model


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    layout = mesh3d.build_mesh(pp=1, dp=-1, tp=1)
    if layout.world_size != 1:
        raise SystemExit(f"train.py runs in one process for now (got world size {layout.world_size})")
    is_main = layout.rank == 0

    dataset = build_dataset(args)
    loader = DistributedLoader.for_layout(dataset, args.global_batch, layout, seed=args.seed)
    model = build_model(args, layout.device)
    optimizer = build_optimizer(model, args)
    n_params = count_parameters(model)
    if is_main:
        print(
            f"{layout}\nmodel {args.config}: {n_params / 1e6:.2f}M parameters, "
            f"data: {len(dataset.tokens) / 1e6:.1f}M tokens ({len(dataset)} samples of {args.seq_len})",
            flush=True,
        )

    metrics_file = None
    if args.metrics and is_main:
        Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
        metrics_file = open(args.metrics, "w")
    history = []
    tokens_per_step = args.global_batch * args.seq_len
    start = time.perf_counter()
    for step in range(args.steps):
        step_start = time.perf_counter()
        lr = lr_at(step, peak=args.lr, warmup=args.warmup, total=args.steps, min_ratio=args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = (t.to(layout.device) for t in next(loader))
        loss = loss_fn(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()

        record = {
            "step": step + 1,
            "loss": loss.item(),
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tokens_per_step / (time.perf_counter() - step_start),
            "elapsed_s": time.perf_counter() - start,
        }
        history.append(record)
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        if is_main and (step % args.log_every == 0 or step + 1 == args.steps):
            print(
                f"step {record['step']:5d}  loss {record['loss']:.4f}  lr {lr:.2e}  "
                f"grad_norm {record['grad_norm']:.3f}  tokens/s {record['tokens_per_s']:,.0f}",
                flush=True,
            )
    if metrics_file:
        metrics_file.close()
    torch.distributed.destroy_process_group()
    return history


if __name__ == "__main__":
    main()
