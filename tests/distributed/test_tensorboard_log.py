"""Without --tensorboard and --wandb, a fresh interpreter that imports train.py loads nothing of TensorBoard or wandb.
(The scalars it writes when on: tests/unit/test_tensorboard_scalars.py.)"""

import subprocess
import sys

from test_torchrun import ROOT, _env


def test_nothing_is_imported_when_off():
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, examples.llama.train; "
            "print(sorted(m for m in sys.modules if {'tensorboard', 'wandb'} & set(m.replace('.', '_').split('_'))))",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['examples.llama.tensorboard_log', 'examples.llama.wandb_log']"
