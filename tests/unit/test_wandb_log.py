"""--wandb's run in this process, offline: train.py's records land in the run file under
TensorBoard's tag names, at their steps, with the run's settings as its config. (That nothing of
wandb is imported without the flag: tests/distributed/test_tensorboard_log.py; train.py writing
one: tests/distributed/test_run_config.py.)"""

import json

import pytest
from wandb_runs import run_file_bytes

from examples.llama.arguments import parse_args
from examples.llama.wandb_log import WandbLog


def test_records_are_logged_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = WandbLog("mesh3d-test", parse_args(["--seq-len", "48", "--profile", "p"]))
    records = [
        {"step": 1, "loss": 5.515625, "lr": 1e-4, "grad_norm": 3.0, "tokens_per_s": 900.0, "memory_peak_gib": 0.75},
        {"step": 2, "loss": 4.8671875, "lr": 2e-4, "grad_norm": None, "tokens_per_s": 950.0},  # never-drain
    ]
    for record in records:
        log.write(record)
    log.close()
    tags = [b"train/loss", b"train/lr", b"train/grad_norm", b"memory/peak_gib"]
    losses = [json.dumps(record["loss"]).encode() for record in records]
    config = [b"seq_len", b"48", b'"2:3"']  # --profile-steps as its flag reads it
    data = run_file_bytes(tmp_path, tags + losses + config)
    missing = [part for part in tags + losses + config if part not in data]
    assert not missing, missing
