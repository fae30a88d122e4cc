"""Schedule drawing: Chrome traces that match the simulation, PNG timelines, the missing-matplotlib hint."""

import json
import sys

import pytest

from mesh3d.pipeline import chrome_trace, draw, simulate

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _complete_events(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_chrome_trace_matches_the_simulation(tmp_path):
    pp, m, v = 2, 4, 2
    report = simulate("interleaved_1f1b", pp, m, v)
    trace = chrome_trace(report)
    events = _complete_events(trace)
    assert len(events) == 2 * pp * m * v  # F and B per stage per microbatch
    assert {e["tid"] for e in events} == set(range(pp))
    assert trace["displayTimeUnit"] == "ms"
    by_key = {(e["args"]["stage"], e["cat"], e["args"]["microbatch"]): e for e in events}
    assert len(by_key) == len(events)
    for timed in report.events:
        a = timed.action
        event = by_key[(a.stage, "forward" if a.kind.value == "F" else "backward", a.microbatch)]
        assert event["name"] == f"{a.kind.value}{a.microbatch} s{a.stage}"
        assert event["tid"] == timed.rank and event["pid"] == 0
        assert event["ts"] == pytest.approx(timed.start * 1000)
        assert event["dur"] == pytest.approx((timed.end - timed.start) * 1000)
        assert event["args"]["chunk"] == a.stage // pp
    metadata = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert {e["args"]["name"] for e in metadata if e["name"] == "thread_name"} == {"pp rank 0", "pp rank 1"}
    assert json.loads(json.dumps(trace)) == trace

    path = tmp_path / "trace.json"
    returned = draw("interleaved_1f1b", pp, m, v, path=path)
    assert returned.bubble_fraction == report.bubble_fraction
    assert json.loads(path.read_text()) == trace


@pytest.mark.parametrize(
    ("name", "pp", "m", "v"),
    [
        ("gpipe", 4, 8, 1),
        ("1f1b", 4, 8, 1),
        ("interleaved_1f1b", 4, 5, 2),
        ("zero_bubble", 4, 8, 1),
        ("zbv", 4, 8, 2),
        ("dualpipev", 4, 8, 2),
    ],
)
def test_draw_png(tmp_path, name, pp, m, v):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"{name}.png"
    report = draw(name, pp, m, v, path=path)
    data = path.read_bytes()
    assert len(data) > 0 and data[:8] == PNG_SIGNATURE
    assert report.bubble_fraction == simulate(name, pp, m, v).bubble_fraction


def test_draw_accepts_a_report(tmp_path):
    pytest.importorskip("matplotlib")
    report = simulate("1f1b", 2, 4)
    path = tmp_path / "custom.png"
    assert draw(report, path=path, title="custom") is report
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_draw_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(ImportError, match=r"mesh3d\[draw\]"):
        draw("gpipe", 2, 2, path=tmp_path / "x.png")
    draw("gpipe", 2, 2, path=tmp_path / "x.json")  # traces need no matplotlib
    assert (tmp_path / "x.json").exists()
