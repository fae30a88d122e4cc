"""train.py's optimizer and its learning-rate schedule: AdamW (matrices decay, norm gains do not),
linear warmup then cosine decay."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup from peak/warmup to peak, then cosine decay to min_ratio*peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def schedule_warning(args) -> str | None:
    """A warning when the run's learning rate never decays, or None: --steps at most --warmup ends
    the run in warm-up (below --lr, the lr still rising) or at its peak. The schedule's other
    phases are then never trained under, which a short trial run easily does unawares."""
    steps, warmup, peak = args.steps, args.warmup, args.lr
    if steps > warmup:
        return None
    shorter = f"pass --warmup {max(1, steps // 10)} (or --steps above {warmup}) for a run that decays"
    if steps < warmup:
        last = lr_at(
            steps - 1, peak=peak, warmup=warmup, total=args.lr_schedule_steps or steps, min_ratio=args.min_lr_ratio
        )
        return (
            f"warning: --steps {steps} ends inside the --warmup {warmup} steps: the lr only rises, to {last:.2e} at "
            f"the last step, never reaching --lr {peak:g} nor decaying; {shorter}"
        )
    return (
        f"warning: --steps {steps} ends as the --warmup {warmup} steps do: the run ends at the peak lr ({peak:g}) "
        f"with no step of decay; {shorter}"
    )


def build_optimizer(params: list[torch.nn.Parameter], args, fused: bool = False) -> torch.optim.AdamW:
    """AdamW over this rank's parameters; matrices decay, norm gains (1-D) do not. A never-drain
    schedule gets it as parallelize's `optimizer=` factory (it steps inside the pipeline). `fused`:
    torch's fused kernel, whose step takes `found_inf`, so that a non-finite step is skipped on the
    device (mesh3d.train.DeviceStepGuard)."""
    params = list(params)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=fused or None)


def schedule_length(args, saved_args: dict | None, start_step: int) -> tuple[int, str | None]:
    """(the step at which the LR schedule ends, a note to print or None).

    A fresh run: --lr-schedule-steps, else --steps. A resumed one keeps the length its checkpoint
    was trained under (saved_args: the arguments train.py kept in it; older checkpoints name only
    `steps`), so changing --steps on resume never moves the LR mid-run; --lr-schedule-steps
    changes it on purpose. Either way a note says what the lr does where the two differ.
    """
    if saved_args is None:
        return (args.lr_schedule_steps or args.steps), None
    saved = saved_args.get("lr_schedule_steps") or saved_args.get("steps") or args.steps
    length = args.lr_schedule_steps or saved

    def lr(step: int, total: int) -> str:
        return f"{lr_at(step, peak=args.lr, warmup=args.warmup, total=total, min_ratio=args.min_lr_ratio):.2e}"

    if length != saved:
        return length, (
            f"note: --lr-schedule-steps {length}: the LR schedule now ends at step {length}, not {saved} as saved; "
            f"the lr goes from {lr(max(start_step - 1, 0), saved)} at step {start_step} to {lr(start_step, length)} at "
            f"step {start_step + 1}"
        )
    if args.steps != saved and args.steps > start_step:
        past = f" (past step {saved} it stays at its final {lr(saved, saved)})" if args.steps > saved else ""
        return length, (
            f"note: the checkpoint's LR schedule ends at step {saved}, and it is kept with --steps {args.steps}"
            f"{past}; pass --lr-schedule-steps {args.steps} to stretch the cosine to step {args.steps} instead"
        )
    return length, None
