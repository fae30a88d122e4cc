"""`mesh3d-plan`: the planner from a shell. Ranks the layouts of a model on a cluster and says why
the best one wins.

    mesh3d-plan --model llama3-70b --gpus 256 --hardware h100 --seq-len 8192 --global-batch 512
    mesh3d-plan --model path/to/config.json --gpus 8 --fix pp=2 --fix schedule=1f1b --draw best.png
    mesh3d-plan --model llama3-8b --gpus 8 --layers-per-stage 0 16 16 0 --fix tp=1
    mesh3d-plan --model config.json --gpus 1024 --verify --verify-ranks 0 515 1023

Prints the ranked table (the top 10, or every plan with --all), then the terms of the step time
and memory that separate the best plan from the runner-up. --draw writes the best plan's
pipeline timeline, replayed with the costs the planner used. --verify dry-runs the best plan on this
CPU (verify_plan.py) and exits 1 where the planner's bytes differ from what the code holds and sends.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from mesh3d.pipeline.schedule.catalog import build_schedule
from mesh3d.pipeline.schedule.simulate import SimulationReport, simulate_schedule
from mesh3d.planner.constants import MEMORY_PREDICTION_BAND
from mesh3d.planner.hardware import HARDWARE
from mesh3d.planner.model_source import PRESETS
from mesh3d.planner.planned_layout import Plan
from mesh3d.planner.ranking import plan
from mesh3d.planner.report import GIB, band_text, hardware_band, near_full_note, table, time_unit, why
from mesh3d.planner.search_space import FIXABLE, memory_limit_bytes, resolve_hardware

_INT_KEYS = ("pp", "dp", "cp", "tp", "ep", "virtual_stages", "microbatches", "dp_shard")
# The table's short column names work in --fix too.
_KEY_ALIASES = {"v": "virtual_stages", "m": "microbatches", "ac": "activation_checkpoint"}
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "none": None}
_BOOLS = {"true": True, "false": False}


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
        "param_dtype takes bf16, fp32 or none; compile and fused_loss take true or false",
    )
    split = p.add_mutually_exclusive_group()
    split.add_argument(
        "--layers-per-stage",
        type=int,
        nargs="+",
        metavar="N",
        help="blocks in each pipeline stage, e.g. 0 2 2 0 (the ends alone): only layouts of that many stages",
    )
    split.add_argument(
        "--split-points",
        nargs="+",
        metavar="NAME",
        help="module names each stage after the first starts at, e.g. layers.4: only layouts of that many stages",
    )
    p.add_argument(
        "--tie-band",
        type=float,
        default=None,
        metavar="FRACTION",
        help="among plans this close in speed, those near the memory limit rank last "
        "(default: the hardware's error band; 0: by speed alone)",
    )
    p.add_argument("--all", action="store_true", help="list every plan that fits, not the top 10")
    p.add_argument(
        "--draw",
        metavar="PATH",
        help="draw the best plan's pipeline timeline: an image (needs matplotlib: "
        "pip install 'mesh3d[draw]') or, for a .json path, a Chrome/Perfetto trace",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="dry-run the best plan on this CPU (mesh3d.dry_run: each played rank set up and stepped under torch's "
        "fake process group) and check the planner's bytes of parameters, gradients, optimizer state and "
        "traffic against it; exit 1 where they differ",
    )
    p.add_argument(
        "--verify-ranks",
        type=int,
        nargs="+",
        default=None,
        metavar="RANK",
        help="the ranks --verify plays (default: the first, a middle and the last of each pipeline stage)",
    )
    p.add_argument(
        "--verify-seq-len",
        type=int,
        default=128,
        metavar="TOKENS",
        help="the sequence length --verify plays: each played rank's step runs for real on this CPU "
        "(the planner is asked again at this length; held bytes do not depend on it)",
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
        elif key in ("compile", "fused_loss"):
            if value.lower() not in _BOOLS:
                raise _UsageError(f"--fix {item!r}: {key} takes true or false")
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

    name, scale = time_unit(best.time.compute_seconds)
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
            tie_band=args.tie_band,
            split_points=args.split_points,
            layers_per_stage=args.layers_per_stage,
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
        + f" by tokens/s per GPU; among those within {band_text(best)} of each other, the ones within "
        f"{MEMORY_PREDICTION_BAND:.0%} of the memory limit last.\n{hardware_band(hardware)}\n"
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
    if args.verify:
        return _verify(model, best, args)
    return 0


def _verify(model, best: Plan, args: argparse.Namespace) -> int:
    """--verify: the best plan dry-run and held to the planner; 0 when they agree, else 1."""
    from mesh3d.planner.verify_plan import verdict, verify_plan

    print(f"\nVerifying #1 on this CPU at seq_len {args.verify_seq_len} (mesh3d.dry_run) ...", flush=True)
    try:
        reports = verify_plan(model, best, args.gpus, args.global_batch, args.verify_seq_len, ranks=args.verify_ranks)
    except (ValueError, RuntimeError) as error:
        _fail(f"--verify: {error}")
    for report in reports:
        print(report.text())
    agreed, line = verdict(reports)
    print(line)
    return 0 if agreed else 1


if __name__ == "__main__":
    sys.exit(main())
