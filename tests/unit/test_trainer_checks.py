"""train.py's checks and notes, as a new user meets them: each said in flags, with what to change.

- a global batch that does not split over --dp and then into --microbatches (found before any
  step, not by pm.step's traceback), against the arithmetic written out here;
- a --seq-len that does not cut into 2 x --cp chunks, and --cp with --hf-model: refused in flags;
- a corpus too small for one batch (and the held-out ones): the sizes and the flags to change;
- resuming: the LR schedule's length kept from the checkpoint unless --lr-schedule-steps, and a
  note where --steps and it differ; a finished run says so; a fresh run's metrics file replaces
  an earlier run's lines and says so, a resumed one appends.
"""

from argparse import Namespace

import pytest

from examples.llama.batch_sizes import batch_split_problem, corpus_problem, resolved_dp, seq_len_problem
from examples.llama.checkpoints import nothing_to_train
from examples.llama.metrics_log import open_metrics
from examples.llama.optimization import lr_at, schedule_length


def test_the_batch_split_is_checked_in_flags():
    assert batch_split_problem(8, 2, 2) is None and batch_split_problem(12, 2, 3) is None
    assert batch_split_problem(10, 2, 2, defaulted=True) == (
        "--global-batch 10 over --dp 2 gives 5 samples per rank, which --microbatches 2 (the default: --pp) does "
        "not divide; use --global-batch 8 or 12 (a multiple of --dp 2 x --microbatches 2 = 4), or a --microbatches "
        "that divides 5"
    )
    assert batch_split_problem(9, 2, 1) == (
        "--global-batch 9 does not split over --dp 2; use --global-batch 8 or 10 (a multiple of --dp 2 x "
        "--microbatches 1 = 2)"
    )
    assert "use --global-batch 8 (" in batch_split_problem(2, 1, 8)  # no smaller multiple to offer
    # Every suggestion splits: a multiple of dp x microbatches.
    for g, dp, m in [(10, 2, 2), (7, 3, 2), (30, 4, 4)]:
        suggested = [
            int(w) for w in batch_split_problem(g, dp, m).split("use --global-batch ")[1].split(" (")[0].split(" or ")
        ]
        assert all(s % (dp * m) == 0 and batch_split_problem(s, dp, m) is None for s in suggested)


def test_dp_is_resolved_as_build_mesh_does():
    assert resolved_dp(2, -1, 2, world_size=8) == 2
    assert resolved_dp(2, 2, 1, world_size=4) == 2
    assert resolved_dp(2, 2, 1, world_size=1) is None  # build_mesh names the sizes that do not fit
    assert resolved_dp(3, -1, 1, world_size=4) is None
    # cp takes its share of the world: pp x dp x cp x tp = world size.
    assert resolved_dp(1, -1, 2, world_size=8, cp=2) == 2
    assert resolved_dp(2, 1, 1, world_size=4, cp=2) == 1
    assert resolved_dp(1, 2, 1, world_size=2, cp=2) is None
    assert resolved_dp(1, -1, 1, world_size=6, cp=4) is None


def test_a_corpus_too_small_says_the_sizes_and_the_flags():
    assert corpus_problem(16, 2049, 128, 16, 0) is None
    said = corpus_problem(3, 400, 128, 16, 0)
    assert said == (
        "the corpus gives 3 samples of --seq-len 128 (400 tokens), fewer than the 16 needed for one "
        "--global-batch 16; pass --global-batch 3 or less, --seq-len 24 or less, more --data"
    )
    # The fixes it names do fit: 3 samples of 128, or 16 samples of 24 tokens from 400.
    assert (400 - 1) // 24 >= 16 and (400 - 1) // 25 < 16
    said = corpus_problem(40, 5121, 128, 16, 4)
    assert "fewer than the 80 needed for one --global-batch 16 plus --eval-batches 4 held out" in said
    assert "--global-batch 8 or less, --eval-batches 1 or less, --seq-len 64 or less, more --data" in said


def _args(**kw):
    return Namespace(**{"steps": 30, "lr_schedule_steps": None, "lr": 3e-3, "warmup": 5, "min_lr_ratio": 0.1, **kw})


def test_a_fresh_run_schedules_over_its_steps():
    assert schedule_length(_args(), None, 0) == (30, None)
    assert schedule_length(_args(lr_schedule_steps=50), None, 0) == (50, None)


def test_resuming_keeps_the_saved_schedule_and_says_so():
    # Same --steps: nothing to say (a restart after a crash).
    assert schedule_length(_args(), {"steps": 30}, 20) == (30, None)
    assert schedule_length(_args(), {"steps": 30, "lr_schedule_steps": 30}, 20) == (30, None)
    # --steps 30 -> 40: the 30-step schedule stays, so the lr does not jump at step 31.
    length, note = schedule_length(_args(steps=40), {"steps": 30, "lr_schedule_steps": 30}, 30)
    assert length == 30
    assert note == (
        "note: the checkpoint's LR schedule ends at step 30, and it is kept with --steps 40 (past step 30 it stays "
        "at its final 3.00e-04); pass --lr-schedule-steps 40 to stretch the cosine to step 40 instead"
    )
    at_step_30 = lr_at(29, peak=3e-3, warmup=5, total=30, min_ratio=0.1)
    at_step_31 = lr_at(30, peak=3e-3, warmup=5, total=length, min_ratio=0.1)
    assert at_step_31 == pytest.approx(3e-4) and at_step_31 <= at_step_30  # it went on down, not back up
    # On purpose: --lr-schedule-steps 40 stretches it, and the note gives the jump.
    length, note = schedule_length(_args(steps=40, lr_schedule_steps=40), {"lr_schedule_steps": 30}, 30)
    assert length == 40 and "ends at step 40, not 30 as saved; the lr goes from 3.11e-04 at step 30 to" in note
    assert f"{lr_at(30, peak=3e-3, warmup=5, total=40, min_ratio=0.1):.2e} at step 31" in note


def test_a_finished_run_says_how_to_go_on():
    assert nothing_to_train(30, _args(lr_schedule_steps=30)) == (
        "already at step 30 of --steps 30: nothing to train. To go on, pass --steps M > 30 (the LR schedule keeps "
        "its 30 steps, the lr staying at its final value past them, unless --lr-schedule-steps M)"
    )
    assert nothing_to_train(35, _args(lr_schedule_steps=35)).startswith("the checkpoint is at step 35, past --steps 30")


def test_metrics_a_fresh_run_replaces_and_says_so_a_resumed_one_appends(tmp_path):
    path, said = tmp_path / "runs" / "train.jsonl", []
    with open_metrics(str(path), False, said.append) as f:
        f.write('{"step": 1}\n')
    assert said == []  # a new file: nothing replaced
    with open_metrics(str(path), True, said.append) as f:
        f.write('{"step": 2}\n')
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n' and said == []
    with open_metrics(str(path), False, said.append) as f:
        f.write('{"step": 1}\n')
    assert path.read_text() == '{"step": 1}\n'
    assert said == [f"metrics: {path} held 2 line(s) of an earlier run; a fresh run replaces them (--resume appends)"]


def test_document_mask_is_refused_with_hf_model(capsys):
    from examples.llama.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--document-mask", "--hf-model", "qwen2"])
    assert "--document-mask is the example's LLaMA model's (its document_ids input)" in capsys.readouterr().err


def test_the_seq_len_is_checked_against_cp(capsys, tmp_path):
    from examples.llama.arguments import parse_args

    assert seq_len_problem(32, 2) is None and seq_len_problem(100, 1) is None and seq_len_problem(8, 4) is None
    assert seq_len_problem(100, 4) == (
        "--seq-len 100 is not divisible by 2 x --cp 4 = 8 (each cp rank takes a chunk from the head and one from "
        "the tail of every sequence); use --seq-len 96 or 104, or another --cp"
    )
    assert "use --seq-len 6, or another --cp" in seq_len_problem(4, 3)  # no smaller multiple to offer
    with pytest.raises(SystemExit):
        parse_args(["--cp", "4", "--seq-len", "100"])
    assert "error: --seq-len 100 is not divisible by 2 x --cp 4 = 8" in capsys.readouterr().err
    assert parse_args(["--cp", "2", "--seq-len", "32"]).cp == 2
    # The same from a --config-file, the command line overriding it.
    run = tmp_path / "run.toml"
    run.write_text("cp = 2\nseq_len = 30\n")
    with pytest.raises(SystemExit):
        parse_args(["--config-file", str(run)])
    assert "error: --seq-len 30 is not divisible by 2 x --cp 2 = 4" in capsys.readouterr().err
    assert parse_args(["--config-file", str(run), "--seq-len", "32"]).cp == 2


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--profile", "p", "--steps", "2"], "--profile-steps 2:3 ends after --steps 2; profile steps up to 2"),
        (["--profile", "p", "--profile-steps", "3:2"], "--profile-steps takes 1 <= A <= B, got '3:2'"),
        (["--profile", "p", "--profile-steps", "a"], "--profile-steps takes A:B (steps, from 1), got 'a'"),
    ],
)
def test_a_profile_window_outside_the_run_is_refused(capsys, flags, said):
    from examples.llama.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(flags)
    assert said in capsys.readouterr().err
