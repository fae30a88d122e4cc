"""Train a LLaMA-style model on the default corpus (the Python standard library's sources).

    # 8 processes on one machine (CPU + gloo here; CUDA + NCCL where there are GPUs):
    torchrun --standalone --nproc-per-node 8 examples/llama/train.py --pp 2 --dp 2 --tp 2
    # one plain process; checkpoints every 50 steps, resumed by the same command under any layout:
    python examples/llama/train.py --steps 100 --checkpoint-dir ckpt --checkpoint-every 50 --resume

docs/training.md has the rest: your data and tokenizer, long sequences (--cp), Hugging Face models
(--hf-model, --init-from-hf, --export-hf), what a run prints and logs.

A short composition of mesh3d's parts, to copy as the start of your own loop: the model is built
on the meta device and handed to mesh3d.parallelize, which splits it into pipeline stages, shards
each with the model's tensor-parallel plan and FSDP2 (or DDP) over the data-parallel ranks.
mesh3d.train brings the resume, the skipping of non-finite steps, the held-out evaluation, the
progress line and the memory figures. AdamW, linear warmup then cosine decay, gradient clipping
over all of pp, dp, cp and tp. With a never-drain schedule (--schedule pipedream or pipedream_2bw)
the optimizer lives inside the pipeline: parallelize builds it (`optimizer=`), pm.step updates each
stage when the schedule's rule says, and the loop only sets the LR (no clipping: no whole gradient
exists at any one moment; the non-finite guard counts bad losses instead of skipping updates).
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from pathlib import Path

import torch

# Run as a script, the repository root is not on sys.path; the example imports itself as a package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mesh3d  # noqa: E402
from examples.llama import arguments  # noqa: E402
from examples.llama.checkpoints import (  # noqa: E402
    export_hf,
    finish_checkpoint,
    nothing_to_train,
    refuse_other_data,
    restore,
    save_checkpoint,
)
from examples.llama.config_errors import agreed_errors_said_once, flags_of, reported_once  # noqa: E402
from examples.llama.fault_injection import FaultInjection  # noqa: E402
from examples.llama.metrics_log import open_step_logs  # noqa: E402
from examples.llama.model import count_parameters, llama_tp_plan  # noqa: E402
from examples.llama.model_choice import build_model  # noqa: E402
from examples.llama.optimization import build_optimizer, lr_at  # noqa: E402
from examples.llama.placement import placement_report  # noqa: E402
from examples.llama.profiling import StepProfiler  # noqa: E402
from examples.llama.step_report import per_sample_inputs, router_terms, run_summary, step_line, step_record  # noqa: E402
from examples.llama.text_data import build_datasets, build_tokenizer, refuse_bad_token_ids  # noqa: E402
from mesh3d.data import DistributedLoader  # noqa: E402
from mesh3d.distributed.rendezvous import restart_count  # noqa: E402
from mesh3d.planner import predict_memory, wants_prediction  # noqa: E402
from mesh3d.train import (  # noqa: E402
    BadLossGuard,
    BadStepGuard,
    HeldOutEvaluator,
    Progress,
    StepMemory,
    due,
    update_expert_bias,
)
from mesh3d.train.flops import device_name, flops_per_token, peak_flops  # noqa: E402


def parse_args(argv: list[str] | None = None):
    return arguments.parse_args(argv, description=__doc__)


def set_up(args):
    """Everything a configuration error can come from, before the first step; the same on every rank."""
    if args.threads:
        torch.set_num_threads(args.threads)
    layout = mesh3d.build_mesh(pp=args.pp, dp=args.dp, cp=args.cp, tp=args.tp, ep=args.ep, timeout=args.timeout)
    arguments.settle_cuda_defaults(args, layout.device)  # bf16 and TF32 on CUDA unless asked otherwise
    if args.placement_report:
        report = placement_report(layout)
        if layout.rank == 0:
            Path(args.placement_report).write_text(json.dumps(report))
    refuse_other_data(args)  # a resume's data settings, before the start-up they would waste
    tokenizer = build_tokenizer(args)
    model, described = build_model(args, tokenizer)
    refuse_bad_token_ids(args, model)  # on meta still: before parallelize's start-up
    n_params, per_token = count_parameters(model), flops_per_token(model, args.seq_len)
    # A never-drain schedule updates inside pm.step, so parallelize builds the optimizer (pm.optimizer).
    inside = functools.partial(build_optimizer, args=args) if arguments.never_drains(args.schedule) else None
    choices = dict(
        schedule=args.schedule,
        microbatches=args.microbatches,
        virtual_stages=args.virtual_stages,
        layers_per_stage=args.layers_per_stage,
        activation_checkpoint=args.activation_checkpoint,
        dp_mode=args.dp_mode,
        param_dtype=arguments.PARAM_DTYPES[args.param_dtype],
        compile=args.compile,
        fused_loss=args.fused_loss,
    )
    prediction = None  # the planner's memory for this layout, beside the first step's peak (rank 0)
    if wants_prediction(layout.device, args.predict_memory) and layout.rank == 0:
        prediction = predict_memory(model, layout, seq_len=args.seq_len, global_batch=args.global_batch, **choices)
    pm = mesh3d.parallelize(
        model,
        layout,
        **choices,
        dp_shard=args.dp_shard,
        # A Hugging Face model's plan is its own (its config's base_model_tp_plan)
        tp_plan=None if args.hf_model else llama_tp_plan(loss_parallel=args.loss_parallel),
        loss_parallel=args.loss_parallel,
        float8=args.float8,
        seed=args.seed,
        optimizer=inside,
    )  # the default loss: next-token cross-entropy over the global batch's counted tokens, any layout
    dataset, heldout = build_datasets(args, tokenizer)
    # By dp rank: the ranks of a cp group load the same rows, and pm.step cuts each sequence over them.
    loader = DistributedLoader.for_layout(dataset, args.global_batch, layout, seed=args.seed)
    optimizer = pm.optimizer if pm.never_drains else build_optimizer(pm.parameters(), args)
    say = (lambda line: print(line, flush=True)) if layout.rank == 0 else (lambda line: None)
    start_step, origin, resumed = restore(args, pm, optimizer, loader, say)
    say(run_summary(args, layout, pm, described, n_params, origin, tokenizer, dataset, heldout, loader))
    progress = Progress(
        args.steps,
        args.global_batch * args.seq_len,
        start_step,
        per_token,
        peak_flops(layout.device),
        layout.world_size,
        device_name(layout.device),
    )
    per_sample = per_sample_inputs(args, tokenizer)
    evaluator = HeldOutEvaluator(heldout, args.global_batch, layout, args.eval_batches, per_sample) if heldout else None
    return layout, pm, optimizer, loader, evaluator, progress, resumed, per_sample, prediction


@agreed_errors_said_once  # a bad batch pm.step found on some rank: one `error:` line, status 2 everywhere
def main(argv: list[str] | None = None) -> list[dict]:
    with reported_once(flags_of(arguments.build_parser())):  # said once, by rank 0, in flags
        args = parse_args(argv)
        layout, pm, optimizer, loader, evaluator, progress, resumed, per_sample, prediction = set_up(args)
    is_main = layout.rank == 0
    fault = FaultInjection.from_env(layout.rank)  # a test hook, off unless MESH3D_FAULT is set
    if fault:
        fault.arm(pm)
    if resumed and progress.start_step >= args.steps and is_main:
        print(nothing_to_train(progress.start_step, args), flush=True)
    # rank 0's --metrics JSONL (--resume appends, a fresh run starts anew), TensorBoard, W&B
    logs = open_step_logs(args, bool(args.resume or args.resume_from), print) if is_main else []
    # A never-drain step's updates have happened when its loss is known: count bad losses, skip nothing.
    guard = BadLossGuard(args.max_bad_steps) if pm.never_drains else BadStepGuard(args.max_bad_steps)
    history, restart = [], restart_count()  # which torchrun attempt
    last_saved = progress.start_step if resumed else None
    pending = None  # --async-checkpoint: the save being written in the background
    memory = StepMemory(layout)  # each step's peak over the ranks, and which rank
    profiler = StepProfiler(args.profile, args.profile_steps, layout.rank, layout.device)  # --profile DIR, or off
    for step in range(progress.start_step, args.steps):
        profiler.before(step + 1)
        step_start = time.perf_counter()
        memory.begin()
        if fault:
            fault.at_step(step + 1)
        lr = lr_at(step, peak=args.lr, warmup=args.warmup, total=args.lr_schedule_steps, min_ratio=args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = next(loader)
        # pm.step's loss comes back on the host (reading it waits for nothing): a step stops the host
        # for its batch check's flag and its loss, and this loop once more for the gradient norm,
        # the non-finite guard's verdict (the same on every rank).
        if pm.never_drains:  # the updates run inside pm.step, each with the lr set above for this batch
            loss, grad_norm, stepped = pm.step(inputs, targets, **per_sample(inputs)).item(), None, True
            guard.observe(loss)
        else:
            optimizer.zero_grad(set_to_none=True)
            loss = pm.step(inputs, targets, **per_sample(inputs)).item()  # the global token-mean loss, on every rank
            grad_norm = pm.clip_grad_norm_(args.grad_clip if args.grad_clip > 0 else math.inf).item()  # NaN/Inf alike
            stepped = guard.allows(grad_norm)
            if stepped:
                optimizer.step()
        if args.expert_bias_rate and stepped:  # the loads summed over every rank: the same update on each
            update_expert_bias(pm, pm.expert_load(), args.expert_bias_rate)
        seconds = time.perf_counter() - step_start
        peak = memory.gather()  # a collective, every step: the same figure on every rank
        first = prediction if step == progress.start_step else None  # the planner's figure, rank 0
        record = step_record(step + 1, loss, lr, grad_norm, seconds, progress, args, restart, stepped, peak, first)
        record.update(router_terms(pm.loss_terms))
        if first:
            print(first.beside(peak), flush=True)
        if evaluator and due(step + 1, args.eval_every, args.steps):
            record.update(evaluator(pm))
        history.append(record)
        for log in logs:
            log.write(record)
        if is_main and (step % args.log_every == 0 or step + 1 == args.steps or "eval_loss" in record):
            print(step_line(progress, record, seconds, peak), flush=True)
        profiler.after(step + 1)
        guard.raise_if_too_many(step + 1, loss if pm.never_drains else grad_norm)
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            pending = save_checkpoint(pm, optimizer, loader, step + 1, args, is_main, fault, pending)
            last_saved = step + 1
    pm.flush()  # a never-drain schedule's last updates (save and export would flush too); nothing otherwise
    if args.checkpoint_dir and last_saved != max(args.steps, progress.start_step):
        pending = save_checkpoint(
            pm, optimizer, loader, max(args.steps, progress.start_step), args, is_main, fault, pending
        )
    finish_checkpoint(pending, is_main)  # published before the export and the end of the process group
    for log in logs:
        log.close()
    if args.export_hf:
        export_hf(pm, args, is_main)
    torch.distributed.destroy_process_group()
    return history


if __name__ == "__main__":
    main()
