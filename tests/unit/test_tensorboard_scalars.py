"""--tensorboard's writer in this process: train.py's records become TensorBoard scalars, read back.
(That nothing of TensorBoard is imported without it: tests/distributed/test_tensorboard_log.py.)"""

import pytest

from examples.llama.tensorboard_log import TensorBoardLog


def test_records_become_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = TensorBoardLog(str(tmp_path / "tb"))
    records = [
        {"step": 1, "loss": 5.5, "lr": 1e-4, "grad_norm": 3.0, "tokens_per_s": 900.0, "tokens": 512},
        {
            "step": 2,
            "loss": 4.5,
            "lr": 2e-4,
            "grad_norm": 2.0,
            "tokens_per_s": 950.0,
            "tokens": 1024,
            "eval_loss": 4.75,
            "eval_perplexity": 115.58,
        },
        {"step": 3, "loss": 4.0, "lr": 2e-4, "grad_norm": None, "tokens_per_s": 990.0, "tokens": 1536},  # never-drain
        {"step": 4, "loss": 4.25, "cross_entropy": 4.125, "router_aux": 0.125, "lr": 2e-4, "tokens_per_s": 990.0},
    ]  # the last with a router loss
    for record in records:
        log.write(record)
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == [
        "eval/loss",
        "eval/perplexity",
        "train/cross_entropy",
        "train/grad_norm",
        "train/loss",
        "train/lr",
        "train/router_aux",
        "train/tokens_per_s",
    ]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 5.5), (2, 4.5), (3, 4.0), (4, 4.25)]
    assert [(e.step, e.value) for e in events.Scalars("train/router_aux")] == [(4, 0.125)]
    assert [e.step for e in events.Scalars("train/grad_norm")] == [1, 2]  # None: no point
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(2, 4.75)]
