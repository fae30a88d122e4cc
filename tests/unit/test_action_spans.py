"""Pipeline actions' profiler spans (mesh3d/pipeline/action_spans.py): their names, and none opened
while no profiler records."""

import contextlib

import torch

from mesh3d.pipeline.action_spans import action_span, span_name
from mesh3d.pipeline.schedule.ir import Action, Kind


def test_span_names_say_kind_stage_microbatch_and_peer():
    assert span_name(Action(0, Kind.F, 1)) == "F stage 0 mb 1"
    assert span_name(Action(3, Kind.W, 0)) == "W stage 3 mb 0"
    assert span_name(Action(0, Kind.SEND_F, 1, peer=1)) == "send F stage 0 mb 1 -> pp 1"
    assert span_name(Action(2, Kind.RECV_B, 0, peer=3)) == "recv B stage 2 mb 0 <- pp 3"


def test_no_span_without_a_profiler_and_one_under_it():
    assert isinstance(action_span(Action(0, Kind.F, 0)), contextlib.nullcontext)
    with torch.profiler.profile() as prof:
        with action_span(Action(1, Kind.I, 2)):
            torch.ones(2).sum()
    assert "I stage 1 mb 2" in {e.name for e in prof.events()}
