"""examples/llama/plot.py: a PNG of two runs' curves, what each panel holds, and a hint without matplotlib."""

import json
import sys

import pytest

from examples.llama import plot


def _write_run(path, steps, scale, resumed_from=None, evaluated=True):
    lines = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "loss": scale * 5 / step,
            "grad_norm": 1.0 / step,
            "tokens_per_s": 1000.0 + step,
            "tokens": step * 512,
        }
        if evaluated and step % 2 == 0:
            record |= {"eval_loss": scale * 6 / step, "eval_perplexity": 0.0}
        lines.append(json.dumps(record))
    if resumed_from:  # a crashed run's steps after the checkpoint, then the resumed run's
        lines[resumed_from:resumed_from] = [
            json.dumps({"step": s, "loss": 99.0, "tokens": 0}) for s in range(resumed_from + 1, steps + 1)
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_two_runs_side_by_side(tmp_path):
    pytest.importorskip("matplotlib")
    a = _write_run(tmp_path / "a.jsonl", 6, 1.0, resumed_from=3)
    b = _write_run(tmp_path / "b.jsonl", 4, 2.0)
    out = plot.main([str(a), str(b), "-o", str(tmp_path / "curves" / "loss.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000

    figure = plot.plot_runs({"a": plot.read_run(a), "b": plot.read_run(b)})
    by_step, by_tokens, grad_norm, throughput = figure.axes
    train_a, eval_a, train_b, eval_b = by_step.lines
    assert list(train_a.get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert list(train_a.get_ydata()) == pytest.approx([5 / s for s in range(1, 7)])  # the crashed run's lines replaced
    assert list(eval_b.get_xdata()) == [2, 4] and list(eval_b.get_ydata()) == pytest.approx([6.0, 3.0])
    assert list(by_tokens.lines[0].get_xdata()) == [512 * s for s in range(1, 7)]
    assert list(grad_norm.lines[1].get_ydata()) == pytest.approx([1 / s for s in range(1, 5)])
    assert list(throughput.lines[0].get_ydata()) == [1001.0 + s for s in range(6)]
    assert [t.get_text() for t in by_step.get_legend().get_texts()] == ["a", "a (eval)", "b", "b (eval)"]


def test_no_eval_legend_without_evaluations(tmp_path):
    pytest.importorskip("matplotlib")
    figure = plot.plot_runs(
        {
            "a": plot.read_run(_write_run(tmp_path / "a.jsonl", 4, 1.0, evaluated=False)),
            "b": plot.read_run(_write_run(tmp_path / "b.jsonl", 4, 1.0)),
        }
    )
    by_step, by_tokens = figure.axes[:2]
    for ax in (by_step, by_tokens):
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b", "b (eval)"]


def test_a_hint_when_matplotlib_is_missing(tmp_path, monkeypatch):
    run = _write_run(tmp_path / "a.jsonl", 2, 1.0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        plot.main([str(run), "-o", str(tmp_path / "loss.png")])
    assert not (tmp_path / "loss.png").exists()


def test_not_a_metrics_file(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"step": 1, "loss": 1}\nnot json\n')
    with pytest.raises(SystemExit, match=r"x.jsonl:2: not a JSON line"):
        plot.read_run(tmp_path / "x.jsonl")


def test_one_run_is_the_title_and_the_legend_says_training_and_eval(tmp_path):
    """The default metrics file is runs/train.jsonl: its legend must not read "train train"."""
    pytest.importorskip("matplotlib")
    figure = plot.plot_runs({"train": plot.read_run(_write_run(tmp_path / "train.jsonl", 4, 1.0))})
    assert figure._suptitle.get_text() == "train"
    for ax in figure.axes[:2]:
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["training", "held-out eval"]
