"""mesh3d.train's resume and parallelize's seed, and checkpoint.save's before_publish hook, on real ranks.

- resume_latest loads rank 0's newest checkpoint on every rank, even where a rank's own listing
  differs; resume_from loads exactly the checkpoint named (weights equal those saved), and refuses
  a missing or unpublished one on every rank;
- before_publish sees every file written and nothing published; an exception it raises is raised
  on every rank and nothing is published;
- parallelize(seed=) gives the weights of the unsplit model's init_weights(seed) at pp x tp = 2 x 2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch.distributed as dist
from checkpoint_cases import build, full_state, train, worst_relative_error
from multiprocess import run_on_ranks
from pipeline_cases import TOLERANCE, meta_model, tp_args

import mesh3d
from examples.llama.model import Transformer, loss_fn
from mesh3d.train import resume_from, resume_latest


def _error_of(fn) -> str | None:
    try:
        fn()
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    finally:
        dist.barrier()  # no rank was left behind in a collective
    return None


def _resume_and_publish(root: str) -> dict:
    root = Path(root)
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=1)
    pm, optimizer, loader = build(layout, True, small=True)
    seen = []

    def look(written: Path) -> None:
        seen.append(
            (written.name, sorted(p.name for p in written.iterdir() if not p.is_dir()), (root / "step2").exists())
        )

    train(pm, optimizer, loader, 1)
    mesh3d.checkpoint.save(root / "step2", pm, optimizer, step=2, before_publish=look)
    at_2 = full_state(pm)
    train(pm, optimizer, loader, 1)
    mesh3d.checkpoint.save(root / "step4", pm, optimizer, step=4)

    def refuse(written: Path) -> None:
        raise RuntimeError("disk check failed")

    result = {
        "seen": seen,
        "refused": _error_of(
            lambda: mesh3d.checkpoint.save(root / "step6", pm, optimizer, step=6, before_publish=refuse)
        ),
    }
    result["latest_after_refusal"] = mesh3d.checkpoint.latest(root)

    # Rank 1 sees no checkpoint (a lagging filesystem): it still resumes rank 0's newest.
    if layout.rank == 1:
        mesh3d.checkpoint.complete_checkpoints = lambda root: []
    path, state = resume_latest(root, pm, optimizer, say=print)
    result["latest"] = (path, state["step"])
    result["missing"] = _error_of(lambda: resume_from(root / "step3", pm, optimizer))
    result["partial"] = _error_of(lambda: resume_from(root / ".step6.partial", pm, optimizer))
    state = resume_from(root / "step2", pm, optimizer)
    result["from"] = state["step"]
    result["error_vs_step2"] = worst_relative_error(full_state(pm), at_2)[0]
    return result


def test_resume_latest_agrees_resume_from_is_exact_and_before_publish_sees_the_files(tmp_path):
    results = run_on_ranks(_resume_and_publish, 2, str(tmp_path), timeout=180)
    # Every shard (one per pp rank), DCP's metadata, the train state and their checksums written; not yet published.
    assert results[0]["seen"] == [
        (".step2.partial", [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "train_state.json"], False)
    ]
    assert results[1]["seen"] == []  # rank 0 publishes, so rank 0 alone calls the hook
    for result in results:
        assert "disk check failed" in result["refused"], result["refused"]
        assert result["latest_after_refusal"] == str(tmp_path / "step4")
        assert result["latest"] == (str(tmp_path / "step4"), 4)
        assert f"no checkpoint at {tmp_path / 'step3'}" in result["missing"]
        assert "is not a complete checkpoint" in result["partial"]
        assert result["from"] == 2 and result["error_vs_step2"] <= TOLERANCE
    assert not (tmp_path / "step6").exists()


def _seeded(seed: int, pp: int, tp: int) -> dict[str, np.ndarray]:
    from examples.llama.model import llama_tp_plan

    layout = mesh3d.build_mesh(pp=pp, dp=1, tp=tp)
    pm = mesh3d.parallelize(
        meta_model(True, args=tp_args(True)), layout, loss_fn=loss_fn, seed=seed, tp_plan=llama_tp_plan()
    )
    return full_state(pm)


def test_parallelize_seed_gives_the_same_model_on_every_layout():
    want = Transformer(tp_args(True))
    want.init_weights(seed=7)
    want = {k: v.detach().numpy() for k, v in want.state_dict().items() if k != "rope"}
    got = run_on_ranks(_seeded, 4, 7, 2, 2, timeout=180)[0]
    assert sorted(got) == sorted(want)
    for name, values in want.items():
        assert np.array_equal(got[name], values), name  # copied from the same fp32 draw: bit for bit
    unseeded = run_on_ranks(_seeded, 1, None, 1, 1, timeout=120)[0]
    assert not np.array_equal(unseeded["layers.0.attention.wq.weight"], want["layers.0.attention.wq.weight"])
