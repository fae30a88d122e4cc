"""README.md's sample output against today's code, at small cost: its step 1 (loss and gradient
norm, which one process computes as the 8 ranks do, to 1e-5) equals one process's first step of
the same command. The whole sample is re-recorded by examples/llama/readme_sample.py;
tests/unit/test_readme_commands.py checks README.md and docs/training.md quote the same run."""

import re
import sys
from pathlib import Path

from train_launch import run_train

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.llama import readme_sample  # noqa: E402


def _loss_and_grad_norm(line: str) -> tuple[float, float]:
    loss, grad_norm = re.search(r"loss (\S+) .*grad_norm (\S+)", line).groups()
    return float(loss), float(grad_norm)


def test_the_readme_step_1_is_todays():
    sample = readme_sample.readme_sample((ROOT / "README.md").read_text())
    recorded = next(line for line in sample if readme_sample.step_of(line) == 1)
    done = run_train(["--steps", "1", "--metrics", ""], timeout=300)  # the README's run, one process
    ran = next(line for line in done.stdout.splitlines() if readme_sample.step_of(line) == 1)
    (loss, grad_norm), (want_loss, want_grad_norm) = _loss_and_grad_norm(ran), _loss_and_grad_norm(recorded)
    assert abs(loss - want_loss) <= 1e-4 and abs(grad_norm - want_grad_norm) <= 1e-3, (ran, recorded)
