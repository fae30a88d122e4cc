"""train.py --cp: context parallelism from the command line, with packed documents.

- A 4-step run at cp = 2 (two ranks, one dp rank: both load the same rows, each sequence cut over
  them) with --document-mask saves at step 2 and evaluates its held-out batch; its placement
  report names the cp group.
- Its step-2 checkpoint resumed at cp = 1, dp = 2 gives steps 3-4 and the step-4 eval loss of
  the uninterrupted run (relative error <= 1e-4, as test_torchrun.py): checkpoints keep no
  layout, and the data position is a global one.
"""

import json
import shutil

from test_torchrun import _assert_close, _losses
from test_train_checkpoint import _run
from text_corpus import documents, write_jsonl


def _evals(metrics) -> list[float]:
    return [json.loads(line)["eval_loss"] for line in metrics.read_text().splitlines() if "eval_loss" in line]


def test_cp_trains_packed_documents_and_resumes_under_another_cp(tmp_path):
    corpus = write_jsonl(tmp_path / "docs.jsonl", documents(300))
    ckpt, straight, placement = tmp_path / "ckpt", tmp_path / "straight.jsonl", tmp_path / "placement.json"
    common = ["--n-layers", "2", "--data", str(corpus), "--eval-every", "2", "--eval-batches", "1", "--document-mask"]
    done = _run(
        "--steps",
        "4",
        *common,
        "--cp",
        "2",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "2",
        "--metrics",
        str(straight),
        "--placement-report",
        str(placement),
        torchrun=2,
    )
    assert "global batch 8 = dp 1 x 8, each sequence cut over cp 2 ranks" in done.stdout
    report = json.loads(placement.read_text())
    assert report["cp_groups"] == [[0, 1]] and report["cp_groups_within_one_node"], report
    assert [r["coordinate"] for r in report["ranks"]] == [[0, 0, 0, 0], [0, 0, 1, 0]]

    resume_dir, resumed = tmp_path / "resume", tmp_path / "resumed.jsonl"
    resume_dir.mkdir()
    shutil.copytree(ckpt / "step2", resume_dir / "step2")
    done = _run(
        "--steps",
        "4",
        *common,
        "--dp",
        "2",
        "--checkpoint-dir",
        str(resume_dir),
        "--resume",
        "--metrics",
        str(resumed),
        torchrun=2,
    )
    assert f"resumed from {resume_dir / 'step2'} (step 2)" in done.stdout
    _assert_close(_losses(resumed), _losses(straight)[2:])
    _assert_close(_evals(resumed)[-1:], _evals(straight)[-1:])
