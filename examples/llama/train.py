"""Train a LLaMA-style model on the default corpus (the Python standard library's sources).

    # 8 processes on one machine (CPU + gloo here; CUDA + NCCL where there are GPUs):
    torchrun --standalone --nproc-per-node 8 examples/llama/train.py --pp 2 --dp 2 --tp 2
    # one plain process:
    python examples/llama/train.py --steps 50 --metrics runs/debug.jsonl

    # checkpoints every 50 steps; after a crash or preemption the same command (any layout) resumes:
    torchrun --standalone --nproc-per-node 8 examples/llama/train.py --pp 2 --dp 2 --tp 2 \
        --checkpoint-dir ckpt --checkpoint-every 50 --resume
    # start from Hugging Face Llama weights, write the result back as safetensors:
    python examples/llama/train.py --init-from-hf path/to/llama --export-hf runs/hf
    # your tokenizer and JSONL/Parquet shards, held-out eval, settings kept in a TOML file:
    python examples/llama/train.py --config-file run.toml --tokenizer tokenizer.json --vocab-size 4096 \
        --data "shards/*.jsonl" --eval-every 50 --eval-batches 4

The model is built on the meta device and handed to mesh3d.parallelize, which splits it into
pipeline stages, shards each with the model's tensor-parallel plan and FSDP2 (or DDP) over the
data-parallel ranks. AdamW, linear warmup then cosine decay, gradient clipping over all of
pp, dp and tp; rank 0 prints a progress line every --log-every steps and writes one JSON line of
metrics per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

# Run as a script, the repository root is not on sys.path; the example imports itself as a package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mesh3d  # noqa: E402
from examples.llama.config import CONFIGS, ModelArgs, get_config  # noqa: E402
from examples.llama.fault_injection import FaultInjection  # noqa: E402
from examples.llama.model import Transformer, count_parameters, llama_tp_plan  # noqa: E402
from examples.llama.run_config import config_file_argv, effective_config_toml  # noqa: E402
from examples.llama.tensorboard_log import TensorBoardLog, tensorboard_available  # noqa: E402 - imports it only when used
from examples.llama.text_data import build_datasets, build_tokenizer, check_vocab  # noqa: E402
from mesh3d.data import DistributedLoader  # noqa: E402
from mesh3d.distributed.rendezvous import restart_count  # noqa: E402
from mesh3d.train import BadStepGuard, HeldOutEvaluator, due, resume_latest  # noqa: E402


PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--dp", type=int, default=-1, help="data-parallel degree (-1: the rest of the world)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (consecutive ranks, one node)")
    p.add_argument("--schedule", default="interleaved_1f1b", choices=sorted(mesh3d.pipeline.SCHEDULES))
    p.add_argument("--microbatches", type=int, default=None, help="per step and dp rank (default: pp)")
    p.add_argument("--virtual-stages", type=int, default=None, help="stages per pp rank (interleaved default: 2)")
    p.add_argument("--dp-mode", default="fsdp", choices=["fsdp", "ddp"])
    p.add_argument("--activation-checkpoint", default="never", choices=["never", "always", "except_last"])
    p.add_argument("--loss-parallel", action="store_true", help="keep logits vocab-sharded over tp for the loss")
    p.add_argument("--param-dtype", default="fp32", choices=sorted(PARAM_DTYPES),
                   help="compute dtype; bf16 keeps fp32 master weights, reduces gradients in fp32")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block (inductor)")
    p.add_argument("--placement-report", default=None, help="rank 0 writes each rank's node and mesh coordinate here (JSON)")
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
    p.add_argument("--data", nargs="*", default=None,
                   help=".txt/.jsonl/.parquet files, directories and globs (default: the stdlib corpus)")
    p.add_argument("--text-field", default="text", help="the JSONL field / Parquet column holding each document")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a Hugging Face tokenizer.json (default: --init-from-hf's tokenizer.json, else bytes)")
    p.add_argument("--tokenize-workers", type=int, default=None, help="processes that tokenize (default: CPUs, <= 8)")
    p.add_argument("--vocab-size", type=int, default=None, help="override the config's vocabulary size")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate on held-out data every N steps (0: never)")
    p.add_argument("--eval-batches", type=int, default=4, help="global batches held out (by --seed) and evaluated")
    p.add_argument("--token-file", default=None, help="a pre-tokenized .npy (or raw, with --token-dtype) file")
    p.add_argument("--token-dtype", default=None)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--metrics", default="runs/train.jsonl", help="JSONL file, one line per step")
    p.add_argument("--tensorboard", default=None, metavar="DIR", help="also log the metrics as TensorBoard scalars here")
    p.add_argument("--config-file", default=None, metavar="TOML",
                   help="settings under the flags' long names with underscores; the command line overrides them")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here, as DIR/step<N>")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (and after the last step)")
    p.add_argument("--keep-last", type=int, default=None, help="keep only the newest K checkpoints")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir that loads, if any (and append to --metrics)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a collective or P2P wait may last before the job fails (a stopped rank); "
                        "default 600, Megatron's --distributed-timeout-minutes 10")
    p.add_argument("--max-bad-steps", type=int, default=3,
                   help="stop after this many optimizer steps in a row skipped for a non-finite gradient norm")
    p.add_argument("--init-from-hf", default=None, metavar="DIR",
                   help="model config and weights from a Hugging Face Llama directory (config.json + safetensors)")
    p.add_argument("--export-hf", default=None, metavar="DIR", help="after training, write the model as Hugging Face safetensors")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(config_file_argv(p, argv) + argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if (args.checkpoint_every or args.keep_last is not None) and not args.checkpoint_dir:
        p.error("--checkpoint-every and --keep-last need --checkpoint-dir")
    if args.timeout <= 0 or args.max_bad_steps < 1:
        p.error("--timeout must be > 0 and --max-bad-steps >= 1")
    if args.checkpoint_every < 0 or (args.keep_last is not None and args.keep_last < 1):
        p.error("--checkpoint-every must be >= 0 and --keep-last >= 1")
    if args.init_from_hf and (args.n_layers is not None or args.tied is not None or args.vocab_size is not None):
        p.error("--init-from-hf takes the model's shape from its config.json; drop --n-layers/--tied/--vocab-size")
    if args.eval_every < 0 or args.eval_batches < 1:
        p.error("--eval-every must be >= 0 and --eval-batches >= 1")
    if args.token_file and (args.tokenizer or args.data):
        p.error("--token-file is already tokenized: drop --tokenizer/--data")
    if args.tensorboard and not tensorboard_available():
        p.error("--tensorboard needs the tensorboard package: pip install tensorboard")
    return args


def lr_at(step: int, *, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup from peak/warmup to peak, then cosine decay to min_ratio*peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_optimizer(model: mesh3d.ParallelModel, args) -> torch.optim.AdamW:
    """AdamW; matrices decay, norm gains (1-D) do not."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def model_config(args) -> ModelArgs:
    """--config with its overrides, or the shape of the Hugging Face model given by --init-from-hf."""
    if args.init_from_hf:
        hf_config = json.loads((Path(args.init_from_hf) / "config.json").read_text())
        config = ModelArgs.from_hf_config(hf_config)
        return config.with_(max_seq_len=max(config.max_seq_len, args.seq_len))
    overrides = {"max_seq_len": max(args.seq_len, 1)}
    if args.n_layers is not None:
        overrides["n_layers"] = args.n_layers
    if args.tied is not None:
        overrides["tie_embeddings"] = args.tied
    if args.vocab_size is not None:
        overrides["vocab_size"] = args.vocab_size
    return get_config(args.config, **overrides)


def build_model(args, tokenizer) -> Transformer:
    """The whole model on the meta device: no memory until parallelize materializes this rank's part."""
    config = model_config(args)
    if not args.token_file:
        check_vocab(tokenizer, config.vocab_size, args.init_from_hf or args.config)
    with torch.device("meta"):
        return Transformer(config)


def parallelize(model: Transformer, layout, args) -> mesh3d.ParallelModel:
    pm = mesh3d.parallelize(
        model,
        layout,
        schedule=args.schedule,
        microbatches=args.microbatches,
        virtual_stages=args.virtual_stages,
        # The default loss: next-token cross-entropy over the global batch's counted tokens
        # (targets of -100 are not counted), exact for any layout and microbatch count.
        activation_checkpoint=args.activation_checkpoint,
        dp_mode=args.dp_mode,
        tp_plan=llama_tp_plan(loss_parallel=args.loss_parallel),
        loss_parallel=args.loss_parallel,
        param_dtype=PARAM_DTYPES[args.param_dtype],
        compile=args.compile,
    )
    if args.seed != 0:  # parallelize ran init_weights() with its default seed 0
        for stage in pm.stages.values():
            stage.init_weights(seed=args.seed)  # by parameter name: the same values for any layout
    return pm


def placement_report(layout) -> dict:
    """Every rank's node (torchrun's GROUP_RANK) and mesh coordinate, and whether each tp group sits on one node."""
    mine = {"rank": layout.rank, "node": int(os.environ.get("GROUP_RANK", 0)), "coordinate": list(layout.coordinate)}
    everyone = [None] * layout.world_size
    torch.distributed.all_gather_object(everyone, mine)
    node_of = {r["rank"]: r["node"] for r in everyone}
    tp_groups = layout.axis_groups("tp")
    return {
        "ranks": everyone,
        "tp_groups": tp_groups,
        "tp_groups_within_one_node": all(len({node_of[r] for r in group}) == 1 for group in tp_groups),
    }


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    layout = mesh3d.build_mesh(pp=args.pp, dp=args.dp, tp=args.tp, timeout=args.timeout)
    is_main = layout.rank == 0
    if args.placement_report:
        report = placement_report(layout)
        if is_main:
            Path(args.placement_report).write_text(json.dumps(report))

    tokenizer = build_tokenizer(args)
    model = build_model(args, tokenizer)  # the vocabulary is checked before any time goes into tokenizing
    dataset, heldout = build_datasets(args, tokenizer)
    loader = DistributedLoader.for_layout(dataset, args.global_batch, layout, seed=args.seed)
    evaluator = HeldOutEvaluator(heldout, args.global_batch, layout, args.eval_batches) if heldout else None
    n_params = count_parameters(model)
    pm = parallelize(model, layout, args)
    optimizer = build_optimizer(pm, args)
    fault = FaultInjection.from_env(layout.rank)  # a test hook, off unless MESH3D_FAULT is set
    if fault:
        fault.arm(pm)
    start_step, origin = 0, f"initialized with seed {args.seed}"
    resume_from, state = None, None
    if args.resume:
        # Weights, optimizer state, RNG and the data position; the layout may differ from the saver's.
        resume_from, state = resume_latest(args.checkpoint_dir, pm, optimizer, say=lambda line: is_main and print(line, flush=True))
    if resume_from:
        loader.load_state_dict(state["data_state"])
        start_step, origin = state["step"], f"resumed from {resume_from} (step {state['step']})"
    elif args.init_from_hf:
        mesh3d.checkpoint.import_safetensors(pm, args.init_from_hf)
        origin = f"weights from {args.init_from_hf}"
    if is_main:
        name = args.init_from_hf or args.config
        print(f"effective config (TOML):\n{effective_config_toml(args)}", flush=True)
        tokenized_by = "pre-tokenized" if args.token_file else repr(tokenizer)
        print(
            f"{layout}\n{pm}\nmodel {name}: {n_params / 1e6:.2f}M parameters, {origin}\n"
            f"tokenizer: {tokenized_by}\n"
            f"data: {len(dataset.tokens) / 1e6:.1f}M tokens ({len(dataset)} samples of {args.seq_len} to train on"
            f"{f', {len(heldout)} held out' if heldout else ''}), "
            f"global batch {args.global_batch} = dp {layout.dp} x {loader.local_batch_size}",
            flush=True,
        )

    metrics_file = None
    if args.metrics and is_main:
        Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
        metrics_file = open(args.metrics, "a" if args.resume else "w")  # a restarted job's log goes on
    tensorboard = TensorBoardLog(args.tensorboard) if args.tensorboard and is_main else None
    history = []
    tokens_per_step = args.global_batch * args.seq_len
    guard = BadStepGuard(args.max_bad_steps)
    restart = restart_count()  # which torchrun attempt writes these lines
    start = time.perf_counter()
    last_saved = start_step if resume_from else None
    for step in range(start_step, args.steps):
        step_start = time.perf_counter()
        if fault:
            fault.at_step(step + 1)
        lr = lr_at(step, peak=args.lr, warmup=args.warmup, total=args.steps, min_ratio=args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = next(loader)
        optimizer.zero_grad(set_to_none=True)
        loss = pm.step(inputs, targets)  # the global token-mean loss, on every rank
        max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")
        grad_norm = pm.clip_grad_norm_(max_norm)  # NaN or Inf when any gradient is, on every rank
        stepped = guard.allows(grad_norm.item())
        if stepped:
            optimizer.step()

        record = {
            "step": step + 1,
            "loss": loss.item(),
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tokens_per_step / (time.perf_counter() - step_start),
            "elapsed_s": time.perf_counter() - start,
            "param_dtype": args.param_dtype,
            "compile": args.compile,
            "restart": restart,
            "skipped": not stepped,
        }
        record["tokens"] = (step + 1) * tokens_per_step
        if evaluator and due(step + 1, args.eval_every, args.steps):
            record.update(evaluator(pm))
        history.append(record)
        if metrics_file:  # rank 0 only
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        if tensorboard:  # rank 0 only
            tensorboard.write(record)
        if is_main and (step % args.log_every == 0 or step + 1 == args.steps or "eval_loss" in record):
            evaluated = (f"  eval_loss {record['eval_loss']:.4f}  eval_ppl {record['eval_perplexity']:.2f}"
                         if "eval_loss" in record else "")
            print(
                f"step {record['step']:5d}  loss {record['loss']:.4f}  lr {lr:.2e}  "
                f"grad_norm {record['grad_norm']:.3f}  tokens/s {record['tokens_per_s']:,.0f}{evaluated}"
                + ("  SKIPPED (non-finite gradient norm)" if not stepped else ""),
                flush=True,
            )
        guard.raise_if_too_many(step + 1, record["grad_norm"])
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(pm, optimizer, loader, step + 1, args, is_main)
            last_saved = step + 1
    final_step = max(args.steps, start_step)
    if args.checkpoint_dir and last_saved != final_step:
        save_checkpoint(pm, optimizer, loader, final_step, args, is_main)
    if metrics_file:
        metrics_file.close()
    if tensorboard:
        tensorboard.close()
    if args.export_hf:
        mesh3d.checkpoint.export_safetensors(pm, args.export_hf)
        if is_main:
            print(f"exported Hugging Face safetensors to {args.export_hf}", flush=True)
    torch.distributed.destroy_process_group()
    return history


def save_checkpoint(pm, optimizer, loader, step: int, args, is_main: bool) -> None:
    began = time.perf_counter()
    path = mesh3d.checkpoint.save(
        Path(args.checkpoint_dir) / f"step{step}", pm, optimizer, step=step, data_state=loader.state_dict(),
        extra={"args": vars(args)}, keep_last=args.keep_last,
    )
    if is_main:
        print(f"saved checkpoint {path} in {time.perf_counter() - began:.2f} s", flush=True)


if __name__ == "__main__":
    main()
