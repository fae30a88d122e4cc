"""README.md's commands and sample stay true to the project: its test command is the one `.ci/run`
runs (same environment, same pytest), its first command is the one examples/llama/readme_sample.py
records, and docs/training.md quotes the same recorded run (its progress line is the README's step
101). tests/distributed/test_readme_sample.py runs step 1 against the record."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.llama import readme_sample  # noqa: E402

README = (ROOT / "README.md").read_text()


def _fields(line: str) -> dict[str, str]:
    """A progress line's deterministic fields: step, loss, lr and grad_norm."""
    return dict(re.findall(r"\b(step|loss|lr|grad_norm) +(\S+)", line))


def test_the_readme_test_command_is_the_ci_one():
    ci = (ROOT / ".ci" / "run").read_text()
    environment = re.findall(r"^export (\w+=\S+)", ci, re.M)
    pytest = re.findall(r"^(python3 -m pytest)$", ci, re.M)
    assert environment == ["OMP_NUM_THREADS=1"] and pytest == ["python3 -m pytest"], (environment, pytest)
    assert f'pip install "torch==2.13.0" -e ".[dev]" && {environment[0]} {pytest[0]}\n' in README


def test_the_sample_is_the_first_command_and_docs_training_quotes_it():
    assert f"torchrun {' '.join(readme_sample.COMMAND)}" in README
    sample = readme_sample.readme_sample(README)
    steps = [readme_sample.step_of(line) for line in sample if readme_sample.step_of(line) is not None]
    assert steps == [1, 51, 101, 151, 200], steps
    line = readme_sample.training_line((ROOT / "docs" / "training.md").read_text())
    step_101 = next(s for s in sample if readme_sample.step_of(s) == 101)
    assert _fields(line) == _fields(step_101) and len(_fields(line)) == 4, (line, step_101)
