"""`--tensorboard DIR`: train.py's metrics as TensorBoard scalars, beside the JSONL file.

Nothing of TensorBoard is imported unless the flag is given, so a run without it pays nothing.
"""

from __future__ import annotations

import importlib.util

# The record's numbers worth a curve, and the TensorBoard tag each goes under.
SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "memory_rise_gib": "memory/rise_gib",  # the largest rise over the ranks (step_memory.py)
    "memory_peak_gib": "memory/peak_gib",  # that rank's peak
    "memory_reserved_gib": "memory/reserved_gib",
    "cross_entropy": "train/cross_entropy",  # with a router loss: the loss's two parts
    "router_aux": "train/router_aux",
    "expert_imbalance": "train/expert_imbalance",  # a mixture's worst block's max/mean load (logging steps)
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
}


def scalars_of(record: dict) -> dict[str, float]:
    """{tag: value} of a step's record, for the curves (a value None, as grad_norm under a
    never-drain schedule, gives no point)."""
    return {tag: record[key] for key, tag in SCALARS.items() if record.get(key) is not None}


def tensorboard_available() -> bool:
    """Whether `--tensorboard` can work, without importing anything (every rank asks before any collective)."""
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardLog:
    """Writes each step's record (train.py's JSONL dict) as scalars at its step."""

    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise SystemExit(f"--tensorboard needs the tensorboard package: pip install tensorboard ({e})") from None
        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: dict) -> None:
        for tag, value in scalars_of(record).items():
            self.writer.add_scalar(tag, value, global_step=record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
