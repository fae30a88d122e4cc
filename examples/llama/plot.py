"""Loss curves from train.py's metrics files: one or several runs side by side, as a PNG.

    python examples/llama/plot.py runs/a.jsonl [runs/b.jsonl ...] -o loss.png

Four panels: training loss (line) and held-out eval loss (markers) against the step and against
the tokens seen, the gradient norm, and the throughput. Each run is one colour, labelled by its
file name (or --labels): "a" and "a (eval)" in the loss legends; a single run's name is the
title. A log that a resumed run appended to keeps, for each step, the line written last: the
steps the resumed run did again replace those of the run that crashed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_run(path: str | Path) -> list[dict]:
    """The records of one metrics file, one per step (the last written wins), in step order."""
    if not Path(path).is_file():
        raise SystemExit(f"{path}: no such metrics file")
    by_step: dict[int, dict] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{number}: not a JSON line ({e.msg}); is this a train.py --metrics file?")
        if not isinstance(record, dict) or "step" not in record:
            raise SystemExit(f"{path}:{number}: a record without a step; is this a train.py --metrics file?")
        by_step[record["step"]] = record
    if not by_step:
        raise SystemExit(f"{path}: no records")
    return [by_step[step] for step in sorted(by_step)]


def _series(records: list[dict], x: str, y: str) -> tuple[list, list]:
    points = [(r[x], r[y]) for r in records if r.get(x) is not None and r.get(y) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_runs(runs: dict[str, list[dict]]):
    """A matplotlib Figure of the runs (label -> records); needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    (by_step, by_tokens), (grad_norm, throughput) = axes
    alone = len(runs) == 1  # one run: its name is the figure's title, the legend says what each curve is
    if alone:
        figure.suptitle(next(iter(runs)))
    for index, (label, records) in enumerate(runs.items()):
        color = f"C{index % 10}"
        trained, held_out = ("training", "held-out eval") if alone else (label, f"{label} (eval)")
        for ax, x in ((by_step, "step"), (by_tokens, "tokens")):
            ax.plot(*_series(records, x, "loss"), color=color, linewidth=1, label=trained)
            evaluated = _series(records, x, "eval_loss")
            if evaluated[0]:  # a run that evaluated nothing gets no empty "eval" legend entry
                ax.plot(*evaluated, color=color, linestyle="--", marker="o", markersize=4, label=held_out)
        grad_norm.plot(*_series(records, "step", "grad_norm"), color=color, linewidth=1, label=label)
        throughput.plot(*_series(records, "step", "tokens_per_s"), color=color, linewidth=1, label=label)
    for ax, title, xlabel, ylabel in (
        (by_step, "loss by step", "step", "cross-entropy (nats)"),
        (by_tokens, "loss by tokens seen", "tokens", "cross-entropy (nats)"),
        (grad_norm, "gradient norm (before clipping)", "step", "norm"),
        (throughput, "throughput", "step", "tokens / s"),
    ):
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    grad_norm.set_yscale("log")
    return figure


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", nargs="+", help="train.py --metrics JSONL files")
    p.add_argument("-o", "--output", default="loss.png", help="the PNG to write")
    p.add_argument("--labels", nargs="+", default=None, help="one name per file (default: the file names)")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.metrics):
        p.error(f"--labels gives {len(args.labels)} names for {len(args.metrics)} files")
    try:
        import matplotlib  # noqa: F401 - only to say clearly what is missing
    except ImportError:
        raise SystemExit(
            "plot.py draws with matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'mesh3d[draw]')"
        ) from None
    labels = args.labels or [Path(m).stem for m in args.metrics]
    if len(set(labels)) != len(labels):  # two runs named alike: tell them apart by their folders
        labels = [str(Path(m).with_suffix("")) for m in args.metrics]
    figure = plot_runs({label: read_run(path) for label, path in zip(labels, args.metrics)})
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    print(f"wrote {output}")
    return output


if __name__ == "__main__":
    sys.exit(main() and 0)
