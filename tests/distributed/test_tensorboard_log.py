"""--tensorboard: train.py's records as TensorBoard scalars, read back; and nothing of TensorBoard loaded without it."""

import subprocess
import sys

import pytest

from examples.llama.tensorboard_log import TensorBoardLog
from test_torchrun import ROOT, _env


def test_records_become_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = TensorBoardLog(str(tmp_path / "tb"))
    records = [{"step": 1, "loss": 5.5, "lr": 1e-4, "grad_norm": 3.0, "tokens_per_s": 900.0, "tokens": 512},
               {"step": 2, "loss": 4.5, "lr": 2e-4, "grad_norm": 2.0, "tokens_per_s": 950.0, "tokens": 1024,
                "eval_loss": 4.75, "eval_perplexity": 115.58}]
    for record in records:
        log.write(record)
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval/loss", "eval/perplexity", "train/grad_norm", "train/loss",
                                               "train/lr", "train/tokens_per_s"]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 5.5), (2, 4.5)]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(2, 4.75)]


def test_nothing_is_imported_when_off():
    done = subprocess.run([sys.executable, "-c", "import sys, examples.llama.train; "
                           "print(sorted(m for m in sys.modules if 'tensorboard' in m.split('.')[-1]))"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['examples.llama.tensorboard_log']"
