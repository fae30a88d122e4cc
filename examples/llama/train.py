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
mesh3d.train brings the resume, the skipping of non-finite steps (on the device), the held-out
evaluation, the progress line and the memory figures; the loop reads the device only on logging
steps (--log-every), so the steps between never wait for it. AdamW (fused), linear warmup then
cosine decay, gradient clipping over all of pp, dp, cp and tp. With a never-drain schedule
(--schedule pipedream or pipedream_2bw) the optimizer lives inside the pipeline: parallelize builds
it (`optimizer=`), pm.step updates each stage when the schedule's rule says, and the loop only sets
the LR (no clipping: no whole gradient exists at any one moment; the non-finite guard counts bad
losses instead of skipping updates).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

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
from examples.llama.dry_run import dry_run_main  # noqa: E402
from examples.llama.fault_injection import FaultInjection  # noqa: E402
from examples.llama.metrics_log import open_step_logs  # noqa: E402
from examples.llama.model import count_parameters  # noqa: E402
from examples.llama.model_choice import build_model  # noqa: E402
from examples.llama.optimization import build_optimizer, lr_at  # noqa: E402
from examples.llama.parallel_options import parallelize_options, planned_choices  # noqa: E402
from examples.llama.placement import placement_report  # noqa: E402
from examples.llama.profiling import StepProfiler  # noqa: E402
from examples.llama.step_report import per_sample_inputs, router_terms, run_summary, step_line, step_record  # noqa: E402
from examples.llama.text_data import build_datasets, build_tokenizer, refuse_bad_token_ids  # noqa: E402
from mesh3d.data import DistributedLoader  # noqa: E402
from mesh3d.distributed.rendezvous import restart_count  # noqa: E402
from mesh3d.planner import predict_memory, wants_prediction  # noqa: E402
from mesh3d.train import (  # noqa: E402
    DeviceStepGuard,
    HeldOutEvaluator,
    Progress,
    StepMemory,
    UnreadSteps,
    due,
    expert_load_record,
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
    choices = planned_choices(args)
    prediction = None  # the planner's memory for this layout, beside the first step's peak (rank 0)
    if wants_prediction(layout.device, args.predict_memory) and layout.rank == 0:
        prediction = predict_memory(model, layout, seq_len=args.seq_len, global_batch=args.global_batch, **choices)
    # each rank's baseline: what it holds before parallelize builds the model (the interpreter, torch,
    # the planner's measuring), so that a step's figure is the rise the planner predicts
    memory = StepMemory(layout)
    # the default loss: next-token cross-entropy over the global batch's counted tokens, any layout
    pm = mesh3d.parallelize(model, layout, **parallelize_options(args))
    dataset, heldout = build_datasets(args, tokenizer)
    # By dp rank: the ranks of a cp group load the same rows, and pm.step cuts each sequence over them.
    loader = DistributedLoader.for_layout(dataset, args.global_batch, layout, seed=args.seed)
    # fused (its step takes found_inf: a non-finite step skipped on the device) unless the parameters mix
    # plain tensors and DTensors, which torch's fused kernel refuses (a Hugging Face TP plan's replicated norms)
    fused = not pm.never_drains and len({isinstance(p, DTensor) for p in pm.parameters()}) <= 1
    optimizer = pm.optimizer if pm.never_drains else build_optimizer(pm.parameters(), args, fused=fused)
    say = (lambda line: print(line, flush=True)) if layout.rank == 0 else (lambda line: None)
    start_step, origin, resumed = restore(args, pm, optimizer, loader, say)
    if fused:  # how the update is computed, not what: an unfused AdamW's checkpoint resumes fused
        for group in optimizer.param_groups:
            group["fused"] = True
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
    return layout, pm, optimizer, loader, evaluator, progress, resumed, per_sample, prediction, memory


@agreed_errors_said_once  # a bad batch pm.step found on some rank: one `error:` line, status 2 everywhere
def main(argv: list[str] | None = None) -> list[dict]:
    with reported_once(flags_of(arguments.build_parser())):  # said once, by rank 0, in flags
        args = parse_args(argv)
        if args.dry_run is not None:  # the job played on this CPU, no training (dry_run.py)
            raise SystemExit(dry_run_main(args))
        layout, pm, optimizer, loader, evaluator, progress, resumed, per_sample, prediction, memory = set_up(args)
    is_main = layout.rank == 0
    fault = FaultInjection.from_env(layout.rank)  # a test hook, off unless MESH3D_FAULT is set
    if fault:
        fault.arm(pm)
    if resumed and progress.start_step >= args.steps and is_main:
        print(nothing_to_train(progress.start_step, args), flush=True)
    # rank 0's --metrics JSONL (--resume appends, a fresh run starts anew), TensorBoard, W&B
    logs = open_step_logs(args, bool(args.resume or args.resume_from), print) if is_main else []
    # Skipped (and, never-drain, counted) on the device: a non-finite step reads nothing back.
    guard = DeviceStepGuard(args.max_bad_steps)
    history, restart = [], restart_count()  # which torchrun attempt
    last_saved = progress.start_step if resumed else None
    pending = None  # --async-checkpoint: the save being written in the background
    profiler = StepProfiler(args.profile, args.profile_steps, layout.rank, layout.device)  # --profile DIR, or off
    # Each step's loss, grad norm and skip, unread on the device until a logging step reads them all
    # at once: a step between logging steps waits for no device (torchtitan's rule).
    unread, window_start = UnreadSteps(), time.perf_counter()
    for step in range(progress.start_step, args.steps):
        evaluating = evaluator is not None and due(step + 1, args.eval_every, args.steps)
        saving = bool(args.checkpoint_every) and (step + 1) % args.checkpoint_every == 0
        printing = step % args.log_every == 0 or step + 1 == args.steps or evaluating
        # a checkpoint's step writes the rows before it; the run's first step holds its memory beside the plan
        logging = printing or saving or step == progress.start_step
        profiler.before(step + 1)
        if logging:
            memory.begin()
        if fault:
            fault.at_step(step + 1)
        lr = lr_at(step, peak=args.lr, warmup=args.warmup, total=args.lr_schedule_steps, min_ratio=args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = next(loader)
        if pm.never_drains:  # the updates run inside pm.step, each with the lr set above for this batch
            loss, grad_norm, skipped = pm.step(inputs, targets, **per_sample(inputs)), None, False
            guard.observe(loss)  # counted, never skipped: its updates have happened
        else:
            optimizer.zero_grad(set_to_none=True)
            loss = pm.step(inputs, targets, **per_sample(inputs))  # the global token-mean loss, unread
            grad_norm = pm.clip_grad_norm_(args.grad_clip if args.grad_clip > 0 else math.inf)  # NaN/Inf alike
            if all(group.get("fused") for group in optimizer.param_groups):
                skipped = guard.step(optimizer, grad_norm)  # the update skipped on the device where it is non-finite
            else:
                skipped = guard.step_on_host(optimizer, grad_norm)  # mixed tensor kinds: one read a step
        loads = None  # a mixture's routed-token counts, read (a collective and a sync) where needed only
        if args.expert_bias_rate and not bool(skipped):  # reads the loads and the skip: a sync each step
            loads = pm.expert_load()
            update_expert_bias(pm, loads, args.expert_bias_rate)
        terms = router_terms(pm.loss_term_tensors)  # a mixture's cross-entropy and router loss, unread
        elapsed = progress.elapsed()
        unread.add(step + 1, loss=loss, grad_norm=grad_norm, skipped=skipped, lr=lr, elapsed=elapsed, **terms)
        if logging:
            rows = unread.read()  # the one read of every step's values since the last logging step
            # the steps' time from the host's side, this read's wait for the device included: their mean
            seconds = (time.perf_counter() - window_start) / len(rows)
            peak = memory.gather()  # a collective, on logging steps: the same figure on every rank
            # this step's expert loads ({} without experts, and no collective then): logging steps only
            experts = expert_load_record(pm.expert_load() if loads is None else loads)
            first = prediction if step == progress.start_step else None  # the planner's figure, rank 0
            if first:
                print(first.beside(peak), flush=True)
            for row in rows:
                here = row["step"] == step + 1
                values = (row["step"], row["loss"], row["lr"], row["grad_norm"], seconds, progress, args, restart)
                record = step_record(*values, not row["skipped"], peak if here else None, first if here else None)
                record.update({name: row[name] for name in ("cross_entropy", "router_aux") if name in row})
                record["elapsed_s"] = row["elapsed"]  # when the host was done with that step
                if here:
                    record.update(experts)
                if here and evaluating:
                    record.update(evaluator(pm))
                history.append(record)
                for log in logs:
                    log.write(record)
            if is_main and printing:
                print(step_line(progress, record, seconds, peak, prediction), flush=True)
        profiler.after(step + 1)
        if logging:
            guard.raise_if_too_many(step + 1)  # after the step is logged, on every rank alike
        if saving:
            pending = save_checkpoint(pm, optimizer, loader, step + 1, args, is_main, fault, pending)
            last_saved = step + 1
        if logging:
            window_start = time.perf_counter()
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
