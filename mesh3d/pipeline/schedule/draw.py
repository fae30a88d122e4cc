"""Draw a simulated pipeline schedule: a PNG timeline (matplotlib) or a Chrome/Perfetto trace (JSON).

One row per pp rank, time along x; each forward (blue), backward (orange; in zero-bubble schedules
the input-gradient half I) and weight-gradient half W (green) is a box labelled with its
microbatch, shaded by the chunk (virtual stage) it belongs to.
"""

from __future__ import annotations

import json
import os

from mesh3d.pipeline.schedule.ir import Kind
from mesh3d.pipeline.schedule.simulate import SimulationReport, simulate

_US = 1000.0  # simulated time units -> trace microseconds, so one unit reads as one millisecond
_CATEGORY = {Kind.F: "forward", Kind.B: "backward", Kind.I: "backward input", Kind.W: "backward weight"}
_COLOURS = {Kind.F: "Blues", Kind.B: "Oranges", Kind.I: "Oranges", Kind.W: "Greens"}


def _title(report: SimulationReport) -> str:
    s = report.schedule
    return f"{s.name} pp={s.pp} m={s.microbatches} v={s.virtual_stages}"


def chrome_trace(report: SimulationReport, path: str | os.PathLike | None = None) -> dict:
    """A Chrome trace (chrome://tracing, ui.perfetto.dev) of `report`: one thread per pp rank.

    Every compute action is a complete ("X") event named like "F3 s1" (kind, microbatch, stage);
    times are simulated units * 1000 microseconds. Written as JSON to `path` if given.
    """
    s = report.schedule
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": _title(report)}}]
    events += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"pp rank {r}"}} for r in range(s.pp)
    ]
    for e in report.events:
        a = e.action
        events.append(
            {
                "name": f"{a.kind.value}{a.microbatch} s{a.stage}",
                "cat": _CATEGORY[a.kind],
                "ph": "X",
                "ts": e.start * _US,
                "dur": (e.end - e.start) * _US,
                "pid": 0,
                "tid": e.rank,
                "args": {"stage": a.stage, "microbatch": a.microbatch, "chunk": a.stage // s.pp},
            }
        )
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace


def draw(
    schedule: str | SimulationReport,
    pp: int | None = None,
    microbatches: int | None = None,
    virtual_stages: int = 1,
    *,
    path: str | os.PathLike,
    f_cost: float = 1.0,
    b_cost: float = 2.0,
    w_cost: float = 0.0,
    title: str | None = None,
) -> SimulationReport:
    """Simulate `schedule` (or take a SimulationReport) and write its timeline to `path`.

        A ".json" path gets a Chrome trace (see `chrome_trace`, no matplotlib needed); any other
        suffix an image in the format matplotlib infers from it (PNG, SVG, PDF, ...). Given a report,
    `pp`, `microbatches`, `virtual_stages` and the costs are ignored. Returns the report.
    """
    if isinstance(schedule, SimulationReport):
        report = schedule
    else:
        if pp is None or microbatches is None:
            raise TypeError("draw(schedule_name, ...) needs pp and microbatches")
        report = simulate(schedule, pp, microbatches, virtual_stages, f_cost=f_cost, b_cost=b_cost, w_cost=w_cost)
    if os.fspath(path).lower().endswith(".json"):
        chrome_trace(report, path)
        return report
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            'drawing a schedule image needs matplotlib: pip install "mesh3d[draw]" (or matplotlib)'
        ) from error
    # A standalone Figure on an Agg canvas, not pyplot: no window, and the caller's backend is left alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    s = report.schedule
    v = s.virtual_stages
    # Light to dark by chunk, so the virtual stages of one rank tell apart at a glance.
    shade = [0.45 + 0.4 * c / max(v - 1, 1) for c in range(v)] if v > 1 else [0.55]

    def colour(kind: Kind, chunk: int) -> tuple[float, float, float, float]:
        return matplotlib.colormaps[_COLOURS[kind]](shade[chunk])

    events = [e for e in report.events if e.end > e.start]  # a W of cost 0 takes no room

    width = min(max(8.0, 0.16 * report.makespan + 1.5), 32.0)
    fig = Figure(figsize=(width, 0.55 * s.pp + 1.6))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    # Fit the labels to the narrowest box; once horizontal text would be too small, stand it on end.
    narrowest = (width - 1.5) / report.makespan * min(e.end - e.start for e in events) * 72  # points
    digits = len(str(s.microbatches - 1))
    upright = narrowest / (0.65 * digits) < 6.0
    font = min(7.0, 0.85 * narrowest) if upright else min(8.0, narrowest / (0.65 * digits))
    for e in events:
        a = e.action
        chunk = a.stage // s.pp
        ax.barh(
            e.rank,
            e.end - e.start,
            left=e.start,
            height=0.8,
            color=colour(a.kind, chunk),
            edgecolor="white",
            linewidth=0.5,
        )
        ax.text(
            (e.start + e.end) / 2,
            e.rank,
            str(a.microbatch),
            ha="center",
            va="center",
            fontsize=font,
            rotation=90 if upright else 0,
            color="white" if shade[chunk] > 0.7 else "black",
        )
    ax.set_yticks(range(s.pp), [f"rank {r}" for r in range(s.pp)])
    ax.set_ylim(s.pp - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, report.makespan)
    weight = f", of which weight gradient = {w_cost:g}" if w_cost else ""
    costs = (
        ""
        if isinstance(schedule, SimulationReport)
        else f" (forward = {f_cost:g}, backward = {b_cost:g}{weight} per stage)"
    )
    ax.set_xlabel("simulated time" + costs)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    kinds = [k for k in (Kind.F, Kind.B, Kind.I, Kind.W) if any(e.action.kind == k for e in events)]
    legend = [
        Patch(color=colour(k, c), label=f"{k.value} chunk {c}" if v > 1 else _CATEGORY[k])
        for k in kinds
        for c in range(v)
    ]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    default = (
        f"{_title(report)}: bubble {report.bubble_fraction:.1%}, peak activations per rank {report.peak_activations}"
    )
    ax.set_title(title if title is not None else default, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return report
