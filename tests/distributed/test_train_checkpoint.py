"""train.py's checkpoint flags: --checkpoint-dir/--checkpoint-every/--keep-last, --resume (on ranks, in
another layout), --export-hf and --init-from-hf.

- A 4-step run in one process saves every 2 steps (keeping the newest 2).
- Its step-2 checkpoint, resumed by `--resume` on 2 ranks at pp=2, gives steps 3-4 the same
  losses as the uninterrupted run, and appends them to its metrics file, each row with every
  rank's memory rise over what it held before the model was built, and the largest rise, its rank
  and peak; the progress line says that rise beside the planner's figure for that rank's stage
  (`--predict-memory`), the first row every rank's planned figure; `--profile` writes each rank's
  torch profiler trace of step 4.
- `--steps 0 --export-hf` exports the initial weights and the byte tokenizer's tokenizer.json;
  `--init-from-hf` of that export trains with the byte tokenizer and the same losses as the run
  initialized by seed.
- `--schedule pipedream_2bw` at pp=2 on 2 ranks (the optimizer inside the pipeline): evaluating,
  saving every 2 steps and exporting on the way; its step-2 checkpoint resumed by `--resume` (in
  one process: PipeDream-2BW's rule does not depend on the layout, and one launch is cheaper) gives
  steps 3-4 and the step-4 eval loss of the uninterrupted run: the checkpoint keeps the weight
  versions the update rule still needs.
Relative error <= 1e-4 (fp32; the pp=2 run sums in another order), as in test_torchrun.py.
"""

import json
import re
import shutil
import subprocess

import pytest
from test_torchrun import TIMEOUT_S, _assert_close, _losses
from train_launch import run_train

from examples.llama.optimization import lr_at
from mesh3d.data import ByteTokenizer, HFTokenizer

TRAIN = ["--seq-len", "32", "--global-batch", "8", "--log-every", "1", "--warmup", "10"]


def _run(*args: str, torchrun: int = 0) -> subprocess.CompletedProcess:
    """train.py in one process, or on `torchrun` ranks as torchrun starts them (tests/train_launch.py)."""
    return run_train([*TRAIN, *args], nproc=torchrun, timeout=TIMEOUT_S)


def test_checkpoint_resume_export_and_init_from_hf(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "straight.jsonl"
    done = _run(
        "--steps",
        "4",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "2",
        "--keep-last",
        "2",
        "--metrics",
        str(metrics),
    )
    assert done.stdout.count("saved checkpoint") == 2
    assert sorted(p.name for p in ckpt.iterdir()) == ["step2", "step4"]
    straight = _losses(metrics)
    saved = json.loads((ckpt / "step4" / "train_state.json").read_text())
    assert saved["step"] == 4 and saved["data_state"]["position"] == 4 * 8 and saved["extra"]["args"]["steps"] == 4

    resume_dir, resumed_metrics = tmp_path / "resume", tmp_path / "resumed.jsonl"
    resume_dir.mkdir()
    shutil.copytree(ckpt / "step2", resume_dir / "step2")
    resumed_metrics.write_text((metrics.read_text().splitlines(keepends=True)[0]))  # a log that goes on
    done = _run(
        "--steps",
        "4",
        "--pp",
        "2",
        "--checkpoint-dir",
        str(resume_dir),
        "--resume",
        "--metrics",
        str(resumed_metrics),
        "--profile",
        str(tmp_path / "profile"),
        "--profile-steps",
        "4",
        "--predict-memory",
        torchrun=2,
    )
    assert f"resumed from {resume_dir / 'step2'} (step 2)" in done.stdout
    # --profile: each rank's Chrome trace of step 4, loadable, with the step's ops in it
    assert done.stdout.count(f"profiled steps 4-4: {tmp_path / 'profile'}/rank<R>.json") == 1
    for rank in (0, 1):
        events = json.loads((tmp_path / "profile" / f"rank{rank}.json").read_text())["traceEvents"]
        assert any(str(e.get("name", "")).startswith("aten::mm") for e in events), rank
    records = [json.loads(line) for line in resumed_metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 3, 4]
    # each row's memory: every rank's rise over its baseline (the interpreter and torch, over 100 MiB, not
    # in it), and the rank that rose most, with its resident peak (the baseline in it)
    for r in records[1:]:
        rises, baselines = r["memory_rise_gib_by_rank"], r["memory_baseline_gib_by_rank"]
        assert len(rises) == len(baselines) == 2 and all(rise > 0 for rise in rises) and min(baselines) > 0.1, r
        assert r["memory_peak_rank"] in (0, 1) and r["memory_rise_gib"] == max(rises) == rises[r["memory_peak_rank"]]
        assert r["memory_peak_gib"] == pytest.approx(r["memory_rise_gib"] + baselines[r["memory_peak_rank"]])
    planned = records[1]["memory_predicted_gib_by_rank"]  # the resumed run's first step: each rank's stage
    assert len(planned) == 2 and max(planned) == pytest.approx(records[1]["memory_predicted_gib"]), records[1]
    # the progress lines: the largest rise beside the planner's figure for that rank
    lines = re.findall(r"mem \+(\d+\.\d\d) GiB \(rank ([01]), planned (\d+\.\d\d) GiB\)", done.stdout)
    assert len(lines) == 2, done.stdout[-3000:]
    for (rise, rank, plan), r in zip(lines, records[1:]):
        assert (float(rise), int(rank)) == (round(r["memory_rise_gib"], 2), r["memory_peak_rank"])
        assert float(plan) == round(planned[int(rank)], 2)
    _assert_close(_losses(resumed_metrics)[1:], straight[2:])
    assert sorted(p.name for p in resume_dir.iterdir()) == ["step2", "step4"]

    initial = tmp_path / "hf_initial"
    done = _run("--steps", "0", "--export-hf", str(initial), "--metrics", str(tmp_path / "none.jsonl"))
    assert (initial / "config.json").is_file() and (initial / "model.safetensors").is_file()
    from_hf = tmp_path / "from_hf.jsonl"
    done = _run("--steps", "2", "--init-from-hf", str(initial), "--dp", "2", "--metrics", str(from_hf), torchrun=2)
    assert f"weights from {initial}" in done.stdout
    assert f"tokenizer: {ByteTokenizer()!r}" in done.stdout  # the export's tokenizer.json, read as bytes
    _assert_close(_losses(from_hf), straight[:2])


def test_resume_says_what_it_does_and_extends_a_run_on_its_schedule(tmp_path):
    """--resume with no checkpoint says it trains from scratch; raising --steps keeps the saved LR schedule
    (the lr goes on at its final value, no jump) and says so, appending to the metrics; resuming a finished run
    says there is nothing to train, and still exports, its config.json naming the tokenizer's end token and
    the byte tokenizer's tokenizer.json beside it."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    common = ["--n-layers", "2", "--warmup", "1", "--checkpoint-dir", str(ckpt), "--resume", "--metrics", str(metrics)]
    done = _run("--steps", "2", *common)
    assert f"--resume: no checkpoint that loads in {ckpt}; training from scratch" in done.stdout
    done = _run("--steps", "3", *common)
    assert "note: the checkpoint's LR schedule ends at step 2, and it is kept with --steps 3" in done.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[2]["lr"] == lr_at(2, peak=3e-3, warmup=1, total=2, min_ratio=0.1) == pytest.approx(3e-4)
    export = tmp_path / "hf"
    done = _run("--steps", "3", *common, "--export-hf", str(export))
    assert "already at step 3 of --steps 3: nothing to train. To go on, pass --steps M > 3" in done.stdout
    assert "  loss " not in done.stdout and "saved checkpoint" not in done.stdout  # no step trained, none saved
    assert len(metrics.read_text().splitlines()) == 3
    assert json.loads((export / "config.json").read_text())["eos_token_id"] == 0  # the byte tokenizer's
    # Its tokenizer beside it, read by the tokenizers library (HFTokenizer) as the byte tokenizer encodes.
    sample = "def héllo():\n\treturn 'wörld 🤖'\x00Ā"
    assert HFTokenizer(export).encode(sample).tolist() == ByteTokenizer().encode(sample).tolist()


def test_resume_from_a_chosen_checkpoint(tmp_path):
    """--resume-from DIR takes that checkpoint, not the newest, and the newer one it saves again is
    said to be replaced; a missing one is an error."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "straight.jsonl"
    _run(
        "--steps",
        "4",
        "--n-layers",
        "2",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "2",
        "--metrics",
        str(metrics),
    )
    straight = _losses(metrics)
    resumed = tmp_path / "resumed.jsonl"
    done = _run(
        "--steps", "4", "--n-layers", "2", "--resume-from", str(ckpt / "step2"), "--metrics", str(resumed),
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
    )  # fmt: skip
    assert f"resumed from {ckpt / 'step2'} (step 2)" in done.stdout
    # the straight run's step4, saved again: said (once; step2 is not saved again)
    assert done.stdout.count("replacing checkpoint") == 1 and f"replacing checkpoint {ckpt / 'step4'}," in done.stdout
    assert [json.loads(line)["step"] for line in resumed.read_text().splitlines()] == [3, 4]
    _assert_close(_losses(resumed), straight[2:])
    missing = run_train(
        [*TRAIN, "--steps", "4", "--n-layers", "2", "--resume-from", str(ckpt / "step3"), "--metrics", ""],
        timeout=TIMEOUT_S,
        check=False,
    )
    assert missing.returncode == 2 and f"no checkpoint at {ckpt / 'step3'}" in missing.stderr, missing.stderr[-3000:]
    assert "Traceback" not in missing.stderr
    # Other data settings: refused before the model is built (the loader would, after the start-up).
    for how in (["--resume-from", str(ckpt / "step2")], ["--resume", "--checkpoint-dir", str(ckpt)]):
        other = run_train(
            ["--seq-len", "16", "--global-batch", "8", "--seed", "3", "--steps", "4", "--n-layers", "2", *how],
            timeout=TIMEOUT_S,
            check=False,
        )
        newest = ckpt / ("step2" if "--resume-from" in how else "step4")
        said = (
            f"resuming from {newest}: its data position belongs to other data settings: "
            "--seq-len 16 (saved: 32), --seed 3 (saved: 0)"
        )
        assert other.returncode == 2 and said in other.stderr, other.stderr[-3000:]
        assert "model debug" not in other.stdout and "Traceback" not in other.stderr


def test_pipedream_2bw_resumes_exactly(tmp_path):
    flags = [
        "--schedule",
        "pipedream_2bw",
        "--n-layers",
        "2",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--eval-batches",
        "1",
    ]
    ckpt, metrics, exported = tmp_path / "ckpt", tmp_path / "straight.jsonl", tmp_path / "hf"
    done = _run(
        *flags,
        "--pp",
        "2",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "2",
        "--metrics",
        str(metrics),
        "--export-hf",
        str(exported),
        torchrun=2,
    )
    straight = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["step"], r["grad_norm"], r["skipped"]) for r in straight] == [(s, None, False) for s in (1, 2, 3, 4)]
    assert [("eval_loss" in r) for r in straight] == [False, True, False, True]
    assert "step     4  loss" in done.stdout and "grad_norm" not in done.stdout  # no whole gradient, no norm
    assert done.stdout.count("saved checkpoint") == 2 and (exported / "model.safetensors").is_file()
    assert json.loads((ckpt / "step2" / "train_state.json").read_text())["extra"]["args"]["grad_clip"] == 0.0

    resume_dir, resumed_metrics = tmp_path / "resume", tmp_path / "resumed.jsonl"
    resume_dir.mkdir()
    shutil.copytree(ckpt / "step2", resume_dir / "step2")
    done = _run(*flags, "--checkpoint-dir", str(resume_dir), "--resume", "--metrics", str(resumed_metrics))
    assert f"resumed from {resume_dir / 'step2'} (step 2)" in done.stdout
    resumed = [json.loads(line) for line in resumed_metrics.read_text().splitlines()]
    assert [r["step"] for r in resumed] == [3, 4]
    _assert_close(
        [r["loss"] for r in resumed] + [resumed[-1]["eval_loss"]],
        [r["loss"] for r in straight[2:]] + [straight[-1]["eval_loss"]],
    )
