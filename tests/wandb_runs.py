"""An offline Weights & Biases run's record file, read back by the tests of --wandb."""

import time


def run_file_bytes(wandb_dir, holding: list[bytes], wait_s: float = 30.0) -> bytes:
    """The one offline run's record file (protobuf records: its keys and JSON values as text), once
    it holds every one of `holding` or `wait_s` has passed: wandb's service process writes it, maybe
    after finish() returns (one run of test_wandb_log failed on the file's bytes, its cause unseen,
    and ten more did not)."""
    deadline = time.monotonic() + wait_s
    while True:
        (path,) = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
        data = path.read_bytes()
        if all(part in data for part in holding) or time.monotonic() > deadline:
            return data
        time.sleep(0.2)
