"""MFU and peak memory of a training step of the LLaMA 1B config on one GPU, bf16, compiled.

    python bench/gpu_step.py                       # Llama 3.2 1B dims, seq 2048, batch 4, bf16, inductor
    python bench/gpu_step.py --activation-checkpoint selective --batch 8
    python bench/gpu_step.py --device cpu --config debug --no-compile --steps 2   # the script's logic, no GPU

One process, pp = dp = tp = 1 (mesh3d's world of one; NCCL on the GPU), the step as train.py runs
it: pm.step, gradient clipping, fused AdamW. Prints the median step time after the warm-up steps
(which compile), tokens/s, the model FLOPs per token (FlopCounterMode on the meta model, forward
and backward, no recompute counted), MFU against the GPU's dense bf16 peak (mesh3d.train.flops)
and the peak memory allocated (torch.cuda.max_memory_allocated) over the whole run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import mesh3d  # noqa: E402
from examples.llama.config import CONFIGS, get_config  # noqa: E402
from examples.llama.model import Transformer, count_parameters, loss_fn  # noqa: E402
from mesh3d.pipeline.config import ACTIVATION_CHECKPOINT_MODES  # noqa: E402
from mesh3d.train.flops import device_name, flops_per_token, mfu, peak_flops  # noqa: E402

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="1B", choices=sorted(CONFIGS))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="samples per step")
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (compilation happens here)")
    parser.add_argument("--activation-checkpoint", default="never", choices=list(ACTIVATION_CHECKPOINT_MODES))
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "bench/gpu_step.py measures a GPU, and CUDA is not available here; run it on a GPU machine "
            "(--device cpu runs the script's logic on the CPU, with no figures worth recording)"
        )
    on_gpu = args.device == "cuda"

    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device=args.device)
    with torch.device("meta"):
        model = Transformer(get_config(args.config, max_seq_len=args.seq_len))
    n_params, per_token = count_parameters(model), flops_per_token(model, args.seq_len)
    pm = mesh3d.parallelize(
        model,
        layout,
        schedule="gpipe",
        microbatches=args.microbatches,
        loss_fn=loss_fn,
        param_dtype=torch.bfloat16,
        activation_checkpoint=args.activation_checkpoint,
        compile=not args.no_compile,
    )
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4, fused=on_gpu)
    vocab = model.args.vocab_size
    generator = torch.Generator().manual_seed(0)
    times = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=generator)
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = pm.step(tokens[:, :-1], tokens[:, 1:])
        pm.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.item()  # on the host already (pm.step read it): it does not wait for the optimizer
        if on_gpu:
            torch.cuda.synchronize()  # the clip and optimizer kernels still queued belong to this step
        if step >= args.warmup:
            times.append(time.perf_counter() - start)

    seconds = statistics.median(times)
    tokens_per_s = args.batch * args.seq_len / seconds
    utilization = mfu(per_token, tokens_per_s, peak_flops(layout.device), 1)
    peak = torch.cuda.max_memory_allocated(layout.device) / GIB if on_gpu else None
    print(
        f"{args.config} ({n_params / 1e6:,.0f}M parameters) on {device_name(layout.device)}, "
        f"torch {torch.__version__}: "
        f"bf16, compile={not args.no_compile}, activation_checkpoint={args.activation_checkpoint}, "
        f"batch {args.batch} x seq {args.seq_len}, {args.microbatches} microbatches"
    )
    print(f"step {seconds * 1e3:.1f} ms (median of {args.steps})  {tokens_per_s:,.0f} tokens/s  last loss {loss:.3f}")
    print(
        f"model FLOPs/token {per_token / 1e9:.2f} GFLOP  MFU {'n/a' if utilization is None else f'{utilization:.1%}'}"
    )
    print(f"peak memory allocated {'n/a (CPU)' if peak is None else f'{peak:.2f} GiB'}")


if __name__ == "__main__":
    main()
