"""How `mesh3d-plan` reads: the ranked table (speeds with their band, memory, headroom) and the
paragraph that says why #1 ranks above #2 (cli.py prints them)."""

from __future__ import annotations

from mesh3d.planner.constants import MEMORY_PREDICTION_BAND
from mesh3d.planner.hardware import Hardware
from mesh3d.planner.planned_layout import Plan
from mesh3d.planner.predict.memory import MemoryBreakdown
from mesh3d.planner.search_space import LAYOUT

GIB = 2**30
# The additive terms of a step (StepTime.seconds is their sum), in words.
STEP_TERMS = {
    "compute_seconds": "the pipeline's compute (its makespan, bubble included)",
    "exposed_dp_seconds": "data-parallel traffic the compute does not hide",
    "optimizer_seconds": "the optimizer's update",
}
MEMORY_TERMS = (
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "recompute",
    "communication",
    "optimizer_step",
    "context_parallel",
)


def _largest_term(memory: MemoryBreakdown) -> str:
    return max(MEMORY_TERMS, key=lambda term: getattr(memory, term))


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}" if n >= GIB / 10 else f"{n / GIB:.3g}"


def _seconds(s: float, unit: tuple[str, float] | None = None) -> str:
    name, scale = unit or time_unit(s)
    return f"{s * scale:.4g} {name}"


def time_unit(s: float) -> tuple[str, float]:
    """The unit that puts `s` seconds at 1 or more: s, ms or us."""
    for name, scale in (("s", 1.0), ("ms", 1e3), ("us", 1e6)):
        if abs(s) * scale >= 1:
            return name, scale
    return "us", 1e6


# A plan predicted above this share of the device's memory is flagged: the prediction's own error
# (docs/plan.md) and the allocator's fragmentation can take the rest.
NEAR_FULL = 0.9


# The settings beyond the layout's columns that a plan hands parallelize, by column: reshard (FSDP's
# reshard_after_forward, which the search varies wherever FSDP runs) always, the others where the
# shown plans differ in them. Two rows that read alike then run alike.
SETTING_COLUMNS = {
    "reshard": "reshard_after_forward",
    "dp_shard": "dp_shard",
    "dtype": "param_dtype",
    "compile": "compile",
    "fused_loss": "fused_loss",
}
ALWAYS_SHOWN = ("reshard",)


def _setting(value: object) -> str:
    if value is None:
        return "-"  # not applicable: DDP or a single dp x cp rank (reshard), no HSDP (dp_shard), fp32 (dtype)
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value).removeprefix("torch.")


def setting_columns(plans: list[Plan]) -> list[str]:
    """The SETTING_COLUMNS the table shows for these plans: ALWAYS_SHOWN, and any the plans differ in."""
    return [
        column
        for column, field_name in SETTING_COLUMNS.items()
        if column in ALWAYS_SHOWN or len({getattr(p, field_name) for p in plans}) > 1
    ]


def table(plans: list[Plan], device_bytes: int | None = None) -> str:
    """The ranked plans as an aligned text table; with `device_bytes`, each plan's headroom on the
    device ("free GiB"), marked "!" above NEAR_FULL of it. Every setting the plans differ in has a
    column (`setting_columns`)."""
    settings = setting_columns(plans)
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
        *settings,
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
                *(_setting(getattr(p, SETTING_COLUMNS[column])) for column in settings),
                f"{p.tokens_per_second_per_gpu:,.0f}{band_text(p)}",
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


def band_text(p: Plan) -> str:
    return f"±{p.error_band:.0%}"


def hardware_band(hardware: Hardware) -> str:
    """One line: how far the hardware's speeds stand from published runs, held out where the
    preset was fitted on some (held_out.py), and the runs it was fitted on."""
    if hardware.held_out is None:
        fitted = f"fitted on: {hardware.fitted_on}" if hardware.fitted_on else "of other GPUs (none fitted on it)"
        return f"{hardware.name}'s speeds stand within ±{hardware.band:.0%} of the published runs {fitted}."
    return (
        f"{hardware.name}'s speeds stand within ±{hardware.band:.0%} of published runs, band "
        f"{hardware.held_out.text()}; fitted on: {hardware.fitted_on}."
    )


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
    names = (*LAYOUT, *SETTING_COLUMNS.values())
    diffs = [f"{n} {getattr(best, n)} vs {getattr(other, n)}" for n in names if getattr(best, n) != getattr(other, n)]
    return ", ".join(diffs) if diffs else "the same layout"


def why(best: Plan, runner_up: Plan | None) -> str:
    """A paragraph: which term of the step time (and of memory) separates the best plan from the runner-up."""
    if runner_up is None:
        return "Only one layout fits, so there is no runner-up to compare it with."
    a, b = best.time, runner_up.time
    unit = time_unit(max(a.seconds, b.seconds))
    diffs = {term: getattr(b, term) - getattr(a, term) for term in STEP_TERMS}
    top = max(diffs, key=lambda term: abs(diffs[term]))
    gain = runner_up.step_seconds / best.step_seconds - 1
    if gain < 0:  # the runner-up is near the memory limit, within the band (band.py)
        free = (runner_up.memory_per_rank.total - best.memory_per_rank.total) / GIB
        return (
            f"#1 ranks above #2 ({_layout_differences(best, runner_up)}) though #2 is predicted {-gain:.1%} "
            f"faster: that is within the {band_text(best)} the planner's speeds stand from published runs, "
            f"and #2's {_gib(runner_up.memory_per_rank.total)} GiB lies within {MEMORY_PREDICTION_BAND:.0%} of the "
            f"memory limit, where the prediction's own error may not fit; #1 leaves {free:.1f} GiB more free. "
            "--tie-band 0 ranks by speed alone."
        )
    lines = [
        f"Why #1 beats #2 ({_layout_differences(best, runner_up)}): its step takes "
        f"{_seconds(a.seconds, unit)} against {_seconds(b.seconds, unit)}"
        + (f" ({gain:.1%} longer for #2)." if gain > 0 else " (a tie; #1 is listed first).")
    ]
    terms = "; ".join(
        f"{STEP_TERMS[t].split(' (')[0]} {_seconds(getattr(a, t), unit)} vs {_seconds(getattr(b, t), unit)}"
        for t in STEP_TERMS
    )
    lines.append(f"The step is the sum of {terms}.")
    if diffs[top] == 0:
        lines.append("No term differs.")
    else:
        lines.append(
            f"The term that differs most is {STEP_TERMS[top]}: {_seconds(abs(diffs[top]), unit)} "
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
    mem_top = max(MEMORY_TERMS, key=lambda t: abs(getattr(ma, t) - getattr(mb, t)))
    lines.append(
        f"Memory per GPU: {_gib(ma.total)} vs {_gib(mb.total)} GiB"
        + (
            f", most apart in {mem_top} ({_gib(getattr(ma, mem_top))} vs {_gib(getattr(mb, mem_top))} GiB)."
            if getattr(ma, mem_top) != getattr(mb, mem_top)
            else ", the same."
        )
    )
    return " ".join(lines)
