"""mesh3d-plan (mesh3d/planner/cli.py) against mesh3d.plan itself, on a small Llama config.json.

The reference is the library call with the same arguments: the command line must print its plans
in its order with its numbers, name the step-time term that really separates #1 from #2, and draw
the timeline the planner timed. tp is pinned to 1 in most runs: probing tp=2 costs seconds and
exercises the planner, not its command line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mesh3d.planner import cli, plan, report  # noqa: E402
from mesh3d.planner.hardware import HARDWARE  # noqa: E402

SIZES = dict(gpus=4, gpus_per_node=4, seq_len=128, global_batch=8)
STEP_TERMS = ("compute_seconds", "exposed_dp_seconds", "optimizer_seconds")


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=256,
    ).save_pretrained(path)
    return path


def _argv(config_dir, *extra: str) -> list[str]:
    return [
        "--model",
        str(config_dir / "config.json"),
        "--gpus",
        "4",
        "--gpus-per-node",
        "4",
        "--seq-len",
        "128",
        "--global-batch",
        "8",
        *extra,
    ]


def _run(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    return out.getvalue()


def _rows(output: str) -> list[list[str]]:
    """The table's data rows, split on whitespace (every cell is one word but the last, 'term GiB')."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rank")) + 2
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def _layout(p) -> list[str]:
    return [
        str(p.pp),
        str(p.dp),
        str(p.cp),
        str(p.tp),
        str(p.ep),
        p.schedule,
        str(p.virtual_stages),
        str(p.microbatches),
        p.activation_checkpoint,
        p.dp_mode,
        report._setting(p.reshard_after_forward),
    ]


@pytest.fixture(scope="module")
def reference(config_dir):
    """plan() itself, tp pinned to 1, ranked by speed alone (the band's ranking: test_plan.py)."""
    config = transformers.AutoConfig.from_pretrained(config_dir)
    return plan(config, **SIZES, fix={"tp": 1}, tie_band=0)


@pytest.fixture(scope="module")
def top_ten(config_dir):
    return _run(_argv(config_dir, "--fix", "tp=1", "--tie-band", "0"))


def test_table_is_plans_top_ten_in_order_with_its_numbers(top_ten, reference):
    rows = _rows(top_ten)
    assert len(reference) > 10 and len(rows) == 10
    assert f"{len(reference)} layouts fit; the top 10" in top_ten
    for i, (row, p) in enumerate(zip(rows, reference), 1):
        assert row[0] == str(i)
        assert row[1:12] == _layout(p)
        assert row[12] == f"{p.tokens_per_second_per_gpu:,.0f}±0%"
        assert row[13] == f"{p.mfu:.1%}" and row[15] == f"{p.bubble_fraction:.1%}"
        assert math.isclose(float(row[14]), p.step_seconds, rel_tol=1e-2)
        assert math.isclose(float(row[16]), p.memory_per_rank.total / 2**30, rel_tol=1e-2)
        free = (HARDWARE["h100"].memory_bytes - p.memory_per_rank.total) / 2**30  # the default --hardware
        assert math.isclose(float(row[17]), free, rel_tol=1e-2) and not row[17].endswith("!")  # a tiny model
        largest = max(
            ("parameters", "gradients", "optimizer", "activations", "recompute", "communication", "context_parallel"),
            key=lambda term: getattr(p.memory_per_rank, term),
        )
        assert row[18] == largest


def test_why_names_the_term_that_differs_most(top_ten, reference):
    a, b = reference[0].time, reference[1].time
    for t in (a, b):  # the paragraph calls the step the sum of these terms
        assert math.isclose(t.seconds, sum(getattr(t, term) for term in STEP_TERMS), rel_tol=1e-9)
    top = max(STEP_TERMS, key=lambda term: abs(getattr(b, term) - getattr(a, term)))
    paragraph = next(line for line in top_ten.splitlines() if line.startswith("Why #1 beats #2"))
    assert f"The term that differs most is {report.STEP_TERMS[top]}" in paragraph
    assert "Memory per GPU:" in paragraph


def test_why_follows_the_terms_not_the_layout(reference):
    """Make the runner-up's exposed data-parallel time the gap: the paragraph must say so."""
    best, second = reference[0], reference[1]
    slower = dataclasses.replace(
        second.time,
        exposed_dp_seconds=best.time.exposed_dp_seconds + best.time.seconds,
        compute_seconds=best.time.compute_seconds,
        optimizer_seconds=best.time.optimizer_seconds,
    )
    text = report.why(best, dataclasses.replace(second, time=slower))
    assert f"The term that differs most is {report.STEP_TERMS['exposed_dp_seconds']}" in text
    assert "no runner-up" in report.why(best, None)


def test_the_band_is_said_and_ranks_by_headroom(config_dir, reference):
    """By default the hardware's band: said above the table with the runs it was fitted on, on
    every speed, and where #1 is the slower of the two (#2 near the limit), the paragraph says why."""
    output = _run(_argv(config_dir, "--fix", "tp=1"))
    band = HARDWARE["h100"].band
    assert f"among those within ±{band:.0%} of each other, the ones within 10% of the memory limit last" in output
    assert HARDWARE["h100"].fitted_on in output
    held_out = HARDWARE["h100"].held_out
    assert f"within ±{band:.0%} of published runs, band {held_out.text()}" in output  # held out, in-sample beside
    assert all(row[12].endswith(f"±{band:.0%}") for row in _rows(output))
    faster, roomier = reference[0], reference[1]
    less = dataclasses.replace(faster.memory_per_rank, activations=faster.memory_per_rank.activations - 2**30)
    roomier = dataclasses.replace(roomier, error_band=band, memory_per_rank=less)
    text = report.why(roomier, faster)
    assert text.startswith("#1 ranks above #2") and "#1 leaves 1.0 GiB more free" in text


def test_all_lists_every_plan(config_dir, reference):
    rows = _rows(_run(_argv(config_dir, "--fix", "tp=1", "--all", "--tie-band", "0")))
    assert [row[0] for row in rows] == [str(i) for i in range(1, len(reference) + 1)]
    assert [row[1:12] for row in rows] == [_layout(p) for p in reference]


def test_fix_pins_typed_values(config_dir):
    fix = cli.parse_fix(
        ["tp=1", "pp=2", "cp=1", "ep=1", "schedule=1f1b", "ac=always", "param_dtype=fp32", "compile=true", "m=4"]
    )
    assert fix == dict(
        tp=1,
        pp=2,
        cp=1,
        ep=1,
        schedule="1f1b",
        activation_checkpoint="always",
        param_dtype=torch.float32,
        compile=True,
        microbatches=4,
    )
    assert cli.parse_fix(["param_dtype=none"]) == {"param_dtype": None}
    assert cli.parse_fix(["fused_loss=True"]) == {"fused_loss": True}
    out = _run(
        _argv(
            config_dir,
            "--fix",
            "tp=1",
            "--fix",
            "pp=2",
            "--fix",
            "schedule=1f1b",
            "--fix",
            "ac=always",
            "--fix",
            "param_dtype=fp32",
            "--all",
        )
    )
    expected = plan(
        transformers.AutoConfig.from_pretrained(config_dir),
        **SIZES,
        fix=dict(tp=1, pp=2, schedule="1f1b", activation_checkpoint="always", param_dtype=torch.float32),
    )
    rows = _rows(out)
    assert [row[1:12] for row in rows] == [_layout(p) for p in expected]
    assert all(row[1] == "2" and row[6] == "1f1b" and row[9] == "always" for row in rows)
    assert "param_dtype float32" in out


def test_the_split_flags_reach_plan(config_dir, capsys):
    """--layers-per-stage (the ends alone) and --split-points plan what plan() plans given them."""
    config = transformers.AutoConfig.from_pretrained(config_dir)
    fix = dict(tp=1, dp=1, schedule="1f1b", activation_checkpoint="never")
    pins = [f"--fix={k}={v}" for k, v in fix.items()]
    splits = (("--layers-per-stage", [0, 2, 2, 0]), ("--split-points", [f"model.layers.{i}" for i in (1, 2, 3)]))
    for flag, value in splits:
        out = _run(_argv(config_dir, *pins, flag, *map(str, value)))
        keyword = flag.removeprefix("--").replace("-", "_")
        expected = plan(config, **SIZES, fix=fix, **{keyword: value})
        assert [row[1:12] for row in _rows(out)] == [_layout(p) for p in expected[:10]]
        assert expected[0].parallelize_kwargs()[keyword] == value
        assert f"{keyword}={value!r}" in out  # the parallelize call that runs #1
    with pytest.raises(SystemExit):
        cli.main(_argv(config_dir, "--layers-per-stage", "0", "0", "4", "0"))
    assert "must list" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one split or the other, refused before planning
        cli.main(_argv(config_dir, "--layers-per-stage", "2", "2", "--split-points", "model.layers.2"))
    assert "not allowed with argument --layers-per-stage" in capsys.readouterr().err


def test_draw_writes_the_timeline_the_planner_timed(config_dir, tmp_path):
    pytest.importorskip("matplotlib")
    png, trace = tmp_path / "best.png", tmp_path / "best.json"
    pins = ["--fix", "tp=1", "--fix", "pp=2", "--fix", "schedule=zero_bubble", "--fix", "dp_mode=fsdp"]
    _run(_argv(config_dir, *pins, "--draw", str(png)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _run(_argv(config_dir, *pins, "--draw", str(trace)))  # a Chrome trace needs no matplotlib
    best = plan(
        transformers.AutoConfig.from_pretrained(config_dir),
        **SIZES,
        fix=dict(tp=1, pp=2, schedule="zero_bubble", dp_mode="fsdp"),
    )[0]
    report = cli.replay(best)
    assert math.isclose(report.makespan, best.time.compute_seconds, rel_tol=1e-9)
    assert math.isclose(report.bubble_fraction, best.bubble_fraction, rel_tol=1e-9)
    boxes = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(boxes) == len(report.events)


def test_draw_without_matplotlib_fails_before_planning(config_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit) as exit_:
        cli.main(_argv(config_dir, "--draw", str(tmp_path / "x.png")))
    assert exit_.value.code == 2
    assert "mesh3d[draw]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--seq-len", "100000"], ["seq_len=100000", "256"]),  # beyond max_position_embeddings
        (["--fix", "pp=two"], ["pp", "whole number"]),
        (["--fix", "colour=red"], ["unknown keys", "colour"]),
        (
            ["--memory-limit", "1KiB", "--fix", "tp=1", "--fix", "pp=2", "--fix", "schedule=1f1b"],
            ["no layout fits", "GiB"],
        ),
    ],
)
def test_errors_are_one_line_and_exit_2(config_dir, capsys, extra, words):
    with pytest.raises(SystemExit) as exit_:
        cli.main(_argv(config_dir, *extra))  # a repeated flag: argparse keeps the last
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("mesh3d-plan: ") and err.count("\n") == 1
    assert all(w in err for w in words), err


def test_unknown_model_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--model", "/no/such/config.json", "--gpus", "8"])
    assert exit_.value.code == 2
    assert "neither a preset" in capsys.readouterr().err


def test_a_plan_near_the_device_memory_is_flagged(reference):
    """Above 90 % of the device's memory: its headroom marked '!' and a line under the table."""
    best = reference[0]
    roomy = int(best.memory_per_rank.total / 0.5)
    tight = int(best.memory_per_rank.total / 0.95)
    assert "!" not in report.table([best], roomy) and report.near_full_note([best], roomy) is None
    row = report.table([best], tight).splitlines()[2].split()
    assert row[17].endswith("!")
    assert report.near_full_note([best], tight).startswith("! #1 above 90% of the device's")
    assert "free GiB" not in report.table([best])  # no device: no headroom column


def test_rows_that_read_alike_run_alike(reference):
    """No two rows of the table are the same text but different plans: every setting a plan hands
    parallelize that the shown plans differ in has a column (reshard_after_forward always)."""
    twin = dataclasses.replace(reference[0], reshard_after_forward=not reference[0].reshard_after_forward)
    compiled = dataclasses.replace(reference[0], compile=True)
    shown = [reference[0], twin, compiled, *reference[1:6]]
    lines = report.table(shown).splitlines()
    header, rows = lines[0].split(), [line.split()[1:] for line in lines[2:]]  # without the rank
    assert "reshard" in header and "compile" in header and "dtype" not in header  # all fp32 here
    for i, a in enumerate(shown):
        for j, b in enumerate(shown[:i]):
            if rows[i] == rows[j]:
                assert a.parallelize_kwargs() == b.parallelize_kwargs(), (i + 1, j + 1)
    assert rows[0] != rows[1]  # only reshard_after_forward tells them apart
    assert "reshard_after_forward" in report._layout_differences(reference[0], twin)
