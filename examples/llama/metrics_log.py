"""train.py's --metrics file: one JSON line per step, written by rank 0.

A fresh run starts the file anew (saying so when it replaces an earlier run's lines); `--resume`
and `--resume-from` append, also when no checkpoint was there yet (a restart before the first
save). Lines of steps that a crashed attempt wrote after its last checkpoint stay, and the resumed
run writes those steps again after them: for each step the line written last is the run's
(plot.py reads the file so).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TextIO


def open_metrics(path: str, append: bool, say: Callable[[str], None]) -> TextIO:
    """The metrics file, opened to append (a resumed run) or anew (a fresh one)."""
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    if not append and file.is_file() and file.stat().st_size:
        lines = sum(1 for line in file.read_text().splitlines() if line.strip())
        say(f"metrics: {path} held {lines} line(s) of an earlier run; a fresh run replaces them (--resume appends)")
    return open(file, "a" if append else "w")
