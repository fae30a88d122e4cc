"""Draw the schedule timelines used in the docs into docs/images/ and print what each costs.

Run from anywhere: python bench/draw_schedules.py (needs matplotlib: pip install "mesh3d[draw]").
"""

from __future__ import annotations

from pathlib import Path

from mesh3d.pipeline import draw, simulate

IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"

FIGURES = [
    ("gpipe", 4, 8, 1),
    ("1f1b", 4, 8, 1),
    ("interleaved_1f1b", 4, 8, 2),
    ("interleaved_1f1b", 4, 5, 2),  # microbatches not a multiple of pp: uneven rounds
    ("zero_bubble", 4, 8, 1),  # drawn with the weight gradient half of each backward (w_cost=1)
    ("zero_bubble", 4, 8, 2),
    ("zbv", 4, 8, 2),
    ("dualpipev", 4, 8, 2),
]
SPLIT_BACKWARD = {"zero_bubble", "zbv", "dualpipev"}
CALLS_IN_A_ROW = [("1f1b", 4, 4, 3), ("pipedream_2bw", 4, 4, 3)]  # (schedule, pp, microbatches, calls)


def main() -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    for name, pp, microbatches, v in FIGURES:
        suffix = f"_v{v}" if v > 1 else ""
        path = IMAGES / f"{name}_pp{pp}_m{microbatches}{suffix}.png"
        report = draw(name, pp, microbatches, v, path=path, w_cost=1.0 if name in SPLIT_BACKWARD else 0.0)
        print(
            f"{path.name}: bubble {report.bubble_fraction:.2%}, "
            f"peak activations per rank {report.peak_activations}, makespan {report.makespan:g}, "
            f"{path.stat().st_size // 1024} KB"
        )
    for name, pp, microbatches, calls in CALLS_IN_A_ROW:
        path = IMAGES / f"{name}_pp{pp}_m{microbatches}_{calls}calls.png"
        report = simulate(name, pp, microbatches, calls=calls)
        draw(
            report,
            path=path,
            title=f"{name}, pp={pp}: {calls} calls of m={microbatches} take {report.makespan:g} "
            f"(forward = 1, backward = 2)",
        )
        print(f"{path.name}: makespan {report.makespan:g}, {path.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
