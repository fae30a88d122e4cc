"""MFU and peak memory of a training step of the LLaMA 1B config on one GPU, bf16, compiled.

    python bench/gpu_step.py                       # Llama 3.2 1B dims, seq 2048, batch 4, bf16, inductor
    python bench/gpu_step.py --activation-checkpoint selective --batch 8
    python bench/gpu_step.py --virtual-stages 4    # the same step as 4 local stages (the engine's own cost)
    python bench/gpu_step.py --profile runs/prof   # one more step profiled: time by kernel kind, SDPA backend
    python bench/gpu_step.py --sdpa-backend cudnn  # the attention on cuDNN's kernel (flash, efficient, math)
    python bench/gpu_step.py --device cpu --config debug --no-compile --steps 2 --profile /tmp/p   # logic, no GPU

One process, pp = dp = tp = 1 (mesh3d's world of one; NCCL on the GPU), the step as train.py runs
it: pm.step, gradient clipping, fused AdamW. Prints the median step time after the warm-up steps
(which compile), tokens/s, the model FLOPs per token (FlopCounterMode on the meta model, forward
and backward, no recompute counted), MFU against the GPU's dense bf16 peak (mesh3d.train.flops)
and the peak memory allocated (torch.cuda.max_memory_allocated) over the whole run.

--virtual-stages V cuts the model into V stages on the one rank (interleaved 1F1B, V microbatches
at least): the same tokens through the pipeline engine's actions and local messages, so its step
against V = 1's is the engine's own cost. --profile DIR records one more step with torch.profiler
(DIR/step.json, a Chrome trace) and prints its time by kernel kind (bench/kernel_kinds.py; on the
CPU by top-level op), the device's idle time within the step, and the SDPA backend its kernels name.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import mesh3d  # noqa: E402
from examples.llama.config import CONFIGS, get_config  # noqa: E402
from examples.llama.model import Transformer, count_parameters, loss_fn  # noqa: E402
from mesh3d.pipeline.config import ACTIVATION_CHECKPOINT_MODES  # noqa: E402
from mesh3d.train.flops import device_name, flops_per_token, mfu, peak_flops  # noqa: E402

GIB = 2**30
SDPA_BACKENDS = {
    "auto": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


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
    parser.add_argument("--virtual-stages", type=int, default=1, help="stages on the one rank (interleaved 1F1B)")
    parser.add_argument("--profile", metavar="DIR", help="profile one more step; its trace goes to DIR/step.json")
    parser.add_argument(
        "--fused-loss", action="store_true", help="the head and the loss fused (parallelize(fused_loss=True))"
    )
    parser.add_argument("--float8", choices=["tensorwise", "rowwise"], help="the blocks' linears in float8 (torchao)")
    parser.add_argument(
        "--sdpa-backend",
        default="auto",
        choices=sorted(SDPA_BACKENDS),
        help="the SDPA kernel the attention must take (auto: torch's choice); one that cannot run the call fails",
    )
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
    staged = args.virtual_stages > 1
    pm = mesh3d.parallelize(
        model,
        layout,
        schedule="interleaved_1f1b" if staged else "gpipe",
        virtual_stages=args.virtual_stages,
        microbatches=max(args.microbatches, args.virtual_stages) if staged else args.microbatches,
        loss_fn=None if args.fused_loss else loss_fn,  # fused: the default (sum, count) loss, the same mean here
        fused_loss=args.fused_loss,
        float8=args.float8,
        param_dtype=torch.bfloat16,
        activation_checkpoint=args.activation_checkpoint,
        compile=not args.no_compile,
    )
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4, fused=on_gpu)
    vocab = model.args.vocab_size
    backend = SDPA_BACKENDS[args.sdpa_backend]

    def attention_kernel():
        return contextlib.nullcontext() if backend is None else sdpa_kernel([backend])

    generator = torch.Generator().manual_seed(0)

    def one_step() -> float:
        tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=generator)
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with attention_kernel():
            loss = pm.step(tokens[:, :-1], tokens[:, 1:])
        pm.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # on the host already (pm.step read it): it does not wait for the optimizer
        if on_gpu:
            torch.cuda.synchronize()  # the clip and optimizer kernels still queued belong to this step
        return time.perf_counter() - start

    losses: list[float] = []
    times = [one_step() for _ in range(args.warmup + args.steps)][args.warmup :]
    loss = losses[-1]
    seconds = statistics.median(times)
    tokens_per_s = args.batch * args.seq_len / seconds
    utilization = mfu(per_token, tokens_per_s, peak_flops(layout.device), 1)
    peak = torch.cuda.max_memory_allocated(layout.device) / GIB if on_gpu else None
    print(
        f"{args.config} ({n_params / 1e6:,.0f}M parameters) on {device_name(layout.device)}, "
        f"torch {torch.__version__}: "
        f"bf16, compile={not args.no_compile}, activation_checkpoint={args.activation_checkpoint}, "
        f"batch {args.batch} x seq {args.seq_len}, {pm.schedule.microbatches} microbatches, "
        f"{args.virtual_stages} stage(s) on the rank, fused_loss={args.fused_loss}, SDPA {args.sdpa_backend}, "
        f"float8={args.float8}"
    )
    print(f"step {seconds * 1e3:.1f} ms (median of {args.steps})  {tokens_per_s:,.0f} tokens/s  last loss {loss:.3f}")
    print(
        f"model FLOPs/token {per_token / 1e9:.2f} GFLOP  MFU {'n/a' if utilization is None else f'{utilization:.1%}'}"
    )
    print(f"peak memory allocated {'n/a (CPU)' if peak is None else f'{peak:.2f} GiB'}")
    if args.profile:
        profile_step(one_step, Path(args.profile), on_gpu)


def profile_step(one_step, out: Path, on_gpu: bool) -> None:
    """One more step under torch.profiler: its Chrome trace, its time by kind, the SDPA backend."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from bench.kernel_kinds import breakdown, sdpa_backend, table

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        seconds = one_step()
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / "step.json"))
    if on_gpu:  # the device's kernels
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:  # the ops the step called, not the ops inside them
        events = [e for e in prof.events() if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    spans = [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6) for e in events]
    print(f"profiled step {seconds * 1e3:.1f} ms, by {'kernel' if on_gpu else 'top-level op'} kind:")
    print(table(breakdown(spans, seconds), seconds))
    print(f"SDPA backend: {sdpa_backend(name for name, _, _ in spans)}  (trace: {out / 'step.json'})")


if __name__ == "__main__":
    main()
