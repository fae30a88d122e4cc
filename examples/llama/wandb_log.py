"""`--wandb PROJECT`: train.py's metrics as a Weights & Biases run, beside the JSONL file.

The run takes the settings of the run as its config (every one, as a checkpoint keeps them) and
each step's record under the same names TensorBoard's scalars have (tensorboard_log.scalars_of).
wandb's own environment chooses the rest: `WANDB_MODE=offline` logs without an account into
`WANDB_DIR` (./wandb by default), for `wandb sync` later; `WANDB_NAME` names the run. Nothing of
wandb is imported unless the flag is given.
"""

from __future__ import annotations

import argparse
import importlib.util

from examples.llama.run_config import args_as_record
from examples.llama.tensorboard_log import scalars_of


def wandb_available() -> bool:
    """Whether `--wandb` can work, without importing anything (every rank asks before any collective)."""
    return importlib.util.find_spec("wandb") is not None


class WandbLog:
    """Logs each step's record (train.py's JSONL dict) at its step, rank 0 only."""

    def __init__(self, project: str, args: argparse.Namespace):
        try:
            import wandb
        except ImportError as e:
            raise SystemExit(f"--wandb needs the wandb package: pip install wandb ({e})") from None
        self.run = wandb.init(project=project, config=args_as_record(args))

    def write(self, record: dict) -> None:
        self.run.log(scalars_of(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()
