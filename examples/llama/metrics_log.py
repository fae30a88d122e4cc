"""train.py's logs of each step's record, written by rank 0: the --metrics file (one JSON line per
step), TensorBoard's and W&B's scalars, each where asked.

A fresh run starts the file anew (saying so when it replaces an earlier run's lines); `--resume`
and `--resume-from` append, also when no checkpoint was there yet (a restart before the first
save). Lines of steps that a crashed attempt wrote after its last checkpoint stay, and the resumed
run writes those steps again after them: for each step the line written last is the run's
(plot.py reads the file so).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from examples.llama.tensorboard_log import TensorBoardLog
from examples.llama.wandb_log import WandbLog


def open_step_logs(args, append: bool, say: Callable[[str], None]) -> list:
    """The logs a step's record goes to (each with `write(record)` and `close()`), as the flags ask."""
    logs: list = [JsonLines(open_metrics(args.metrics, append, say))] if args.metrics else []
    logs += [TensorBoardLog(args.tensorboard)] if args.tensorboard else []
    return logs + ([WandbLog(args.wandb, args)] if args.wandb else [])


class JsonLines:
    """The --metrics file as a log: a line per record, flushed (a crash loses no written step)."""

    def __init__(self, file: TextIO):
        self.file = file

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def open_metrics(path: str, append: bool, say: Callable[[str], None]) -> TextIO:
    """The metrics file, opened to append (a resumed run) or anew (a fresh one)."""
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    if not append and file.is_file() and file.stat().st_size:
        lines = sum(1 for line in file.read_text().splitlines() if line.strip())
        say(f"metrics: {path} held {lines} line(s) of an earlier run; a fresh run replaces them (--resume appends)")
    return open(file, "a" if append else "w")
