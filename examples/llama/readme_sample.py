"""Re-record the README's sample output from today's code.

    python examples/llama/readme_sample.py      # about 6 minutes of a 2-core CPU, nothing else running

Runs the README's first command (torchrun, 8 ranks at pp = dp = tp = 2, train.py's defaults: 200
steps of 16 x 128 tokens), keeps the run's summary and every fifth progress line (steps 1, 51, 101,
151 and the last), and writes them into README.md's sample block, and its step 101 line into
docs/training.md's example of a progress line: the two documents quote one run. Losses and
gradient norms are deterministic (the same on every run of the same code); times are this
machine's. tests/distributed/test_readme_sample.py keeps the record true at small cost (step 1's
loss and gradient norm in one process, which equal the 8 ranks'), tests/unit/test_readme_commands.py
that the documents quote the same run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TRAINING = ROOT / "docs" / "training.md"
# The README's first command, after `torchrun`.
COMMAND = ["--standalone", "--nproc-per-node", "8", "examples/llama/train.py", "--pp", "2", "--dp", "2", "--tp", "2"]
EVERY = 50  # train.py prints every 10th step (--log-every); the sample keeps every fifth of those
# README.md's sample block: the fenced block after this sentence's start.
README_BLOCK = re.compile(r"(What the first command printed[^\n]*\n(?:[^\n]+\n)*?\n```\n)(.*?)(```)", re.S)
# docs/training.md's example progress line: the fenced block after this sentence.
TRAINING_LINE = re.compile(r"(Every `--log-every` steps[^\n]*rank 0 prints\n\n```\n)(step[^\n]*\n)(```)")
STEP = re.compile(r"^step +(\d+) ")


def step_of(line: str) -> int | None:
    """The step a progress line reports, or None for any other line."""
    match = STEP.match(line)
    return int(match.group(1)) if match else None


def sample_lines(stdout: str) -> list[str]:
    """The run's summary (every line before the first step's) and steps 1, 1 + EVERY, ... and the last."""
    lines = stdout.splitlines()
    steps = [i for i, line in enumerate(lines) if step_of(line) is not None]
    last = steps[-1]
    kept = [i for i in steps if (step_of(lines[i]) - 1) % EVERY == 0 or i == last]
    return lines[: steps[0]] + [lines[i] for i in kept]


def readme_sample(text: str) -> list[str]:
    """The lines of README.md's sample block."""
    return README_BLOCK.search(text).group(2).splitlines()


def training_line(text: str) -> str:
    """docs/training.md's example progress line."""
    return TRAINING_LINE.search(text).group(2).rstrip("\n")


def record() -> list[str]:
    """Run the README's command (in a scratch directory: its metrics file stays there) and keep its sample."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "torch.distributed.run", *COMMAND]
    command[command.index("examples/llama/train.py")] = str(ROOT / "examples" / "llama" / "train.py")
    with tempfile.TemporaryDirectory(prefix="readme-sample-") as scratch:
        done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the README's command failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return sample_lines(done.stdout)


def write(lines: list[str]) -> None:
    """README.md's sample block and docs/training.md's progress line (step 101's), from `lines`."""
    readme = README_BLOCK.sub(lambda m: m.group(1) + "\n".join(lines) + "\n" + m.group(3), README.read_text())
    README.write_text(readme)
    line = next(line for line in lines if step_of(line) == 1 + 2 * EVERY)
    TRAINING.write_text(TRAINING_LINE.sub(lambda m: m.group(1) + line + "\n" + m.group(3), TRAINING.read_text()))


def main() -> None:
    lines = record()
    write(lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
