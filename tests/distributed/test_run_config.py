"""train.py with `--config-file run.toml`: the effective config printed once and checkpointed (and logged
for TensorBoard and, offline, to Weights & Biases when they are installed). Parsing the file:
tests/unit/test_run_config_file.py."""

import importlib.util
import json

from test_torchrun import TIMEOUT_S
from train_launch import run_train
from wandb_runs import run_file_bytes


def test_train_prints_and_checkpoints_the_effective_config(tmp_path):
    (tmp_path / "run.toml").write_text("steps = 2\nseq_len = 16\nglobal_batch = 4\nn_layers = 2\nwarmup = 1\n")
    ckpt = tmp_path / "ckpt"
    tensorboard = ["--tensorboard", str(tmp_path / "tb")] if importlib.util.find_spec("tensorboard") else []
    wandb = ["--wandb", "mesh3d-test"] if importlib.util.find_spec("wandb") else []
    offline = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    done = run_train(
        [
            "--config-file",
            str(tmp_path / "run.toml"),
            "--steps",
            "1",
            "--checkpoint-dir",
            str(ckpt),
            "--metrics",
            str(tmp_path / "m.jsonl"),
            *tensorboard,
            *wandb,
        ],
        env=offline,
        timeout=TIMEOUT_S,
    )
    assert done.stdout.count("effective config") == 1 and "\nseq_len = 16\n" in done.stdout
    saved = json.loads((ckpt / "step1" / "train_state.json").read_text())["extra"]["args"]
    assert (saved["steps"], saved["seq_len"], saved["global_batch"], saved["n_layers"]) == (1, 16, 4, 2)
    assert saved["config_file"] == str(tmp_path / "run.toml")
    if tensorboard:  # the same run, logged for TensorBoard too
        assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    if wandb:  # and to Weights & Biases: the step's loss in the offline run's records
        (record,) = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
        wanted = [b"train/loss", json.dumps(record["loss"]).encode()]
        data = run_file_bytes(tmp_path, wanted)
        assert all(part in data for part in wanted), (wanted, data[-500:])
