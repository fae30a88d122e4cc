"""`mesh3d-plan`: the planner from a shell. Ranks the layouts of a model on a cluster and says why
the best one wins.

    mesh3d-plan --model llama3-70b --gpus 256 --hardware h100 --seq-len 8192 --global-batch 512
    mesh3d-plan --model path/to/config.json --gpus 8 --fix pp=2 --fix schedule=1f1b --draw best.png

Prints the ranked table (the top 10, or every plan with --all), then the terms of the step time
and memory that separate the best plan from the runner-up. --draw writes the best plan's
pipeline timeline, replayed with the costs the planner used.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from mesh3d.pipeline.schedule.catalog import build_schedule
from mesh3d.pipeline.schedule.simulate import SimulationReport, simulate_schedule
from mesh3d.planner.hardware import HARDWARE
from mesh3d.planner.model_source import PRESETS
from mesh3d.planner.predict.memory import MemoryBreakdown
from mesh3d.planner.ranking import Plan, plan
from mesh3d.planner.search_space import FIXABLE, LAYOUT, memory_limit_bytes, resolve_hardware

GIB = 2**30
_INT_KEYS = ("pp", "dp", "cp", "tp", "ep", "virtual_stages", "microbatches")
# The table's short column names work in --fix too.
_KEY_ALIASES = {"v": "virtual_stages", "m": "microbatches", "ac": "activation_checkpoint"}
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "none": None}
_BOOLS = {"true": True, "false": False}
# The additive terms of a step (StepTime.seconds is their sum), in words.
_STEP_TERMS = {
    "compute_seconds": "the pipeline's compute (its makespan, bubble included)",
    "exposed_dp_seconds": "data-parallel traffic the compute does not hide",
    "optimizer_seconds": "the optimizer's update",
}
_MEMORY_TERMS = (
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "recompute",
    "communication",
    "optimizer_step",
    "context_parallel",
)


class _UsageError(ValueError):
    """A flag's value the command line cannot turn into a plan() argument."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mesh3d-plan",
        description="Rank the (pp, dp, cp, tp, ep, schedule, microbatches, checkpointing) layouts of a model on a "
        "cluster by predicted tokens/s per GPU, keeping those that fit in memory.",
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"a preset ({', '.join(sorted(PRESETS))}), or a Hugging Face config.json or model directory",
    )
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; tensor parallelism stays in one (8)")
    p.add_argument("--hardware", default="h100", help=f"{', '.join(sorted(HARDWARE))} or this-machine (h100)")
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (8192)")
    p.add_argument("--global-batch", type=int, default=256, help="sequences per step (256)")
    p.add_argument(
        "--memory-limit",
        default=None,
        help="bytes a GPU may hold, e.g. 80GiB or 75GB (default: the hardware's memory less a margin)",
    )
    p.add_argument(
        "--fix",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"pin a choice, repeatable: {', '.join(FIXABLE)} (v, m, ac for short); "
        "param_dtype takes bf16, fp32 or none; compile takes true or false",
    )
    p.add_argument("--all", action="store_true", help="list every plan that fits, not the top 10")
    p.add_argument(
        "--draw",
        metavar="PATH",
        help="draw the best plan's pipeline timeline: an image (needs matplotlib: "
        "pip install 'mesh3d[draw]') or, for a .json path, a Chrome/Perfetto trace",
    )
    return p


def parse_fix(items: list[str]) -> dict:
    """`["pp=8", "schedule=1f1b", "param_dtype=none"]` as plan()'s `fix` dict (values typed)."""
    fix = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = _KEY_ALIASES.get(key.strip(), key.strip()), value.strip()
        if not sep or not key or not value:
            raise _UsageError(f"--fix {item!r}: write KEY=VALUE, e.g. --fix pp=8")
        if key in _INT_KEYS:
            try:
                fix[key] = int(value)
            except ValueError:
                raise _UsageError(f"--fix {item!r}: {key} takes a whole number") from None
        elif key == "param_dtype":
            if value.lower() not in _DTYPES:
                raise _UsageError(f"--fix {item!r}: param_dtype takes one of {list(_DTYPES)}")
            fix[key] = _DTYPES[value.lower()]
        elif key == "compile":
            if value.lower() not in _BOOLS:
                raise _UsageError(f"--fix {item!r}: compile takes true or false")
            fix[key] = _BOOLS[value.lower()]
        else:  # strings; plan() checks keys and values against what mesh3d runs
            fix[key] = value
    return fix


def load_model(name: str):
    """A preset name as is; a path to a config.json or a model directory as its Hugging Face config."""
    if name in PRESETS:
        return name
    if os.path.exists(name):
        try:
            from transformers import AutoConfig
        except ImportError:
            raise _UsageError(
                f"--model {name}: reading a Hugging Face config needs transformers: pip install 'mesh3d[hf]'"
            ) from None
        try:
            return AutoConfig.from_pretrained(name)
        except (OSError, ValueError, KeyError) as error:
            raise _UsageError(
                f"--model {name}: not a Hugging Face config.json or model directory ({' '.join(str(error).split())})"
            ) from None
    raise _UsageError(
        f"--model {name!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor an existing "
        "config.json or model directory"
    )


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "none (the model's dtype)" if dtype is None else str(dtype).removeprefix("torch.")


def _largest_term(memory: MemoryBreakdown) -> str:
    return max(_MEMORY_TERMS, key=lambda term: getattr(memory, term))


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}" if n >= GIB / 10 else f"{n / GIB:.3g}"


def _seconds(s: float, unit: tuple[str, float] | None = None) -> str:
    name, scale = unit or _unit(s)
    return f"{s * scale:.4g} {name}"


def _unit(s: float) -> tuple[str, float]:
    """The unit that puts `s` seconds at 1 or more: s, ms or us."""
    for name, scale in (("s", 1.0), ("ms", 1e3), ("us", 1e6)):
        if abs(s) * scale >= 1:
            return name, scale
    return "us", 1e6


# A plan predicted above this share of the device's memory is flagged: the prediction's own error
# (docs/plan.md) and the allocator's fragmentation can take the rest.
NEAR_FULL = 0.9


def table(plans: list[Plan], device_bytes: int | None = None) -> str:
    """The ranked plans as an aligned text table; with `device_bytes`, each plan's headroom on the
    device ("free GiB"), marked "!" above NEAR_FULL of it."""
    header = [
        "rank",
        "pp",
        "dp",
        "cp",
        "tp",
        "ep",
        "schedule",
        "v",
        "m",
        "ac",
        "dp_mode",
        "tokens/s/GPU",
        "MFU",
        "step s",
        "bubble %",
        "mem GiB",
        *(["free GiB"] if device_bytes else []),
        "largest (GiB)",
    ]
    rows = []
    for i, p in enumerate(plans, 1):
        mem = p.memory_per_rank
        big = _largest_term(mem)
        rows.append(
            [
                str(i),
                str(p.pp),
                str(p.dp),
                str(p.cp),
                str(p.tp),
                str(p.ep),
                p.schedule,
                str(p.virtual_stages),
                str(p.microbatches),
                p.activation_checkpoint,
                p.dp_mode,
                f"{p.tokens_per_second_per_gpu:,.0f}",
                f"{p.mfu:.1%}",
                f"{p.step_seconds:.3g}",
                f"{p.bubble_fraction:.1%}",
                _gib(mem.total),
                *([_headroom(mem.total, device_bytes)] if device_bytes else []),
                f"{big} {_gib(getattr(mem, big))}",
            ]
        )
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(len(header))]
    left = {"schedule", "ac", "dp_mode", "largest (GiB)"}
    lines = []
    for r in [header] + rows:
        cells = [cell.ljust(w) if name in left else cell.rjust(w) for cell, w, name in zip(r, widths, header)]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _near_full(total: float, device_bytes: int) -> bool:
    return total > NEAR_FULL * device_bytes


def _headroom(total: float, device_bytes: int) -> str:
    return _gib(device_bytes - total) + ("!" if _near_full(total, device_bytes) else "")


def near_full_note(plans: list[Plan], device_bytes: int) -> str | None:
    """A line under the table when a shown plan is flagged, or None."""
    flagged = [str(i) for i, p in enumerate(plans, 1) if _near_full(p.memory_per_rank.total, device_bytes)]
    if not flagged:
        return None
    return (
        f"! #{', #'.join(flagged)} above {NEAR_FULL:.0%} of the device's {device_bytes / GIB:.1f} GiB: the "
        "prediction's own error (docs/plan.md) and the allocator's fragmentation can take the rest; "
        "prefer a roomier layout near its speed, or set --memory-limit."
    )


def _layout_differences(best: Plan, other: Plan) -> str:
    diffs = [f"{n} {getattr(best, n)} vs {getattr(other, n)}" for n in LAYOUT if getattr(best, n) != getattr(other, n)]
    return ", ".join(diffs) if diffs else "the same layout"


def why(best: Plan, runner_up: Plan | None) -> str:
    """A paragraph: which term of the step time (and of memory) separates the best plan from the runner-up."""
    if runner_up is None:
        return "Only one layout fits, so there is no runner-up to compare it with."
    a, b = best.time, runner_up.time
    unit = _unit(max(a.seconds, b.seconds))
    diffs = {term: getattr(b, term) - getattr(a, term) for term in _STEP_TERMS}
    top = max(diffs, key=lambda term: abs(diffs[term]))
    gain = runner_up.step_seconds / best.step_seconds - 1
    lines = [
        f"Why #1 beats #2 ({_layout_differences(best, runner_up)}): its step takes "
        f"{_seconds(a.seconds, unit)} against {_seconds(b.seconds, unit)}"
        + (f" ({gain:.1%} longer for #2)." if gain > 0 else " (a tie; #1 is listed first).")
    ]
    terms = "; ".join(
        f"{_STEP_TERMS[t].split(' (')[0]} {_seconds(getattr(a, t), unit)} vs {_seconds(getattr(b, t), unit)}"
        for t in _STEP_TERMS
    )
    lines.append(f"The step is the sum of {terms}.")
    if diffs[top] == 0:
        lines.append("No term differs.")
    else:
        lines.append(
            f"The term that differs most is {_STEP_TERMS[top]}: {_seconds(abs(diffs[top]), unit)} "
            f"{'less' if diffs[top] > 0 else 'more'} for #1."
        )
    if top == "compute_seconds":
        lines.append(
            f"Inside it: bubble {a.bubble_fraction:.1%} vs {b.bubble_fraction:.1%}, tensor-parallel "
            f"collectives {_seconds(a.tp_seconds, unit)} vs {_seconds(b.tp_seconds, unit)} per stage and "
            f"microbatch, a boundary message {_seconds(a.p2p_seconds, unit)} vs "
            f"{_seconds(b.p2p_seconds, unit)}"
            + (
                f", context-parallel K/V exchanges {_seconds(a.cp_seconds, unit)} vs {_seconds(b.cp_seconds, unit)} "
                "per stage and microbatch"
                if a.cp_seconds or b.cp_seconds
                else ""
            )
            + (
                f", expert all-to-alls {_seconds(a.ep_seconds, unit)} vs {_seconds(b.ep_seconds, unit)} "
                "per stage and microbatch"
                if a.ep_seconds or b.ep_seconds
                else ""
            )
            + "."
        )
    ma, mb = best.memory_per_rank, runner_up.memory_per_rank
    mem_top = max(_MEMORY_TERMS, key=lambda t: abs(getattr(ma, t) - getattr(mb, t)))
    lines.append(
        f"Memory per GPU: {_gib(ma.total)} vs {_gib(mb.total)} GiB"
        + (
            f", most apart in {mem_top} ({_gib(getattr(ma, mem_top))} vs {_gib(getattr(mb, mem_top))} GiB)."
            if getattr(ma, mem_top) != getattr(mb, mem_top)
            else ", the same."
        )
    )
    return " ".join(lines)


def replay(best: Plan, scale: float = 1.0) -> SimulationReport:
    """The best plan's pipeline timeline, played again with the costs per stage the planner used
    (times `scale`: 1.0 gives seconds, and a makespan equal to the plan's `time.compute_seconds`)."""
    t = best.time
    schedule = build_schedule(best.schedule, best.pp, best.microbatches, best.virtual_stages)
    return simulate_schedule(
        schedule,
        f_cost=[f * scale for f in t.forward_seconds],
        b_cost=[b * scale for b in t.backward_seconds],
        w_cost=[w * scale for w in t.weight_grad_seconds],
        comm_cost=t.p2p_seconds * scale,
    )


def draw_plan(best: Plan, path: str) -> SimulationReport:
    """Write the best plan's timeline to `path` (an image, or a Chrome trace for .json) in a readable unit."""
    from mesh3d.pipeline.schedule.draw import draw

    name, scale = _unit(best.time.compute_seconds)
    report = replay(best, scale)
    draw(report, path=path, title=f"{best.row()}: bubble {report.bubble_fraction:.1%}, time in {name}")
    return report


def _needs_matplotlib(path: str | None) -> bool:
    return path is not None and not path.lower().endswith(".json")


def _fail(message: str) -> None:
    """One line on stderr, exit status 2 (as argparse does for a bad flag)."""
    message = " ".join(message.split()).removeprefix("plan: ")
    print(f"mesh3d-plan: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns 0, or exits with status 2 and a one-line message on a bad request."""
    args = _parser().parse_args(argv)
    if _needs_matplotlib(args.draw):  # before minutes of planning, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _fail(f"--draw {args.draw} needs matplotlib: pip install 'mesh3d[draw]' (or draw a .json Chrome trace)")
    try:
        fix = parse_fix(args.fix)
        model = load_model(args.model)
        hardware = resolve_hardware(args.hardware)
        limit = memory_limit_bytes(args.memory_limit, hardware)
        plans = plan(
            model,
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            hardware=hardware,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            memory_limit=limit,
            fix=fix,
        )
    except (ValueError, ImportError) as error:
        _fail(str(error))
    best = plans[0]
    shown = plans if args.all else plans[:10]
    print(
        f"{args.model} on {args.gpus} x {hardware.name} ({args.gpus_per_node} per node), seq_len {args.seq_len}, "
        f"global batch {args.global_batch}, param_dtype {_dtype_name(best.param_dtype)}"
        f"{', compiled' if best.compile else ''}, memory limit {limit / GIB:.1f} GiB: {len(plans)} layouts fit; "
        + ("all of them" if len(shown) == len(plans) else f"the top {len(shown)} (--all for every one)")
        + " by tokens/s per GPU.\n"
    )
    print(table(shown, hardware.memory_bytes))
    note = near_full_note(shown, hardware.memory_bytes)
    if note:
        print(note)
    print()
    print(why(best, plans[1] if len(plans) > 1 else None))
    kwargs = ", ".join(f"{k}={v!r}" for k, v in best.parallelize_kwargs().items())
    print(f"\nRun #1: mesh3d.parallelize(model, {kwargs})")
    if args.draw:
        try:
            draw_plan(best, args.draw)
        except (ImportError, OSError) as error:
            _fail(f"--draw {args.draw}: {error}")
        print(f"Drew #1's timeline to {args.draw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
