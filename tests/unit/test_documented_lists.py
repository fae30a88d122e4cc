"""The lists the docs repeat are the code's: schedule names and their defaults (virtual stages,
microbatch counts), the default schedule and microbatches, activation-checkpoint modes and dp modes.

Each place that names them (parallelize's docstring, docs/pipeline.md, docs/training.md,
docs/parallelize.md) is read as text and compared with the catalog and with what
PipelineConfig.resolve actually picks.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from mesh3d import parallelize
from mesh3d.data_parallel import DP_MODES
from mesh3d.model.intake import protocol_anatomy
from mesh3d.pipeline.config import ACTIVATION_CHECKPOINT_MODES, PipelineConfig
from mesh3d.pipeline.schedule.catalog import DEFAULT_MICROBATCHES, SCHEDULES, build_schedule

DOCS = Path(__file__).resolve().parents[2] / "docs"
DEFAULTS = {name: p.default for name, p in inspect.signature(parallelize).parameters.items()}


def flat(text: str) -> str:
    """Whitespace collapsed, so a wrapped line reads as one."""
    return re.sub(r"\s+", " ", text)


def docstring_arg(name: str) -> str:
    """The text of one argument in parallelize's Args section, up to the next argument."""
    doc = inspect.getdoc(parallelize)
    match = re.search(rf"^    {name}: (.*?)(?=^    \w+: |\Z)", doc, re.S | re.M)
    assert match, f"parallelize's docstring does not describe {name}"
    return flat(match.group(1))


def table_row(doc: str, first_cell: str) -> str:
    """The markdown table row whose first cell starts with `first_cell`."""
    match = re.search(rf"^\| {re.escape(first_cell)}.*\|$", (DOCS / doc).read_text(), re.M)
    assert match, f"docs/{doc} has no table row for {first_cell}"
    return match.group(0)


def quoted(text: str) -> set[str]:
    return set(re.findall(r'"(\w+)"', text))


def flag_choices(flag: str) -> set[str]:
    match = re.search(rf"`{flag} \{{([\w,]+)\}}`", (DOCS / "training.md").read_text())
    assert match, f"docs/training.md does not list {flag}'s choices"
    return set(match.group(1).split(","))


def tiny_model(n_layers: int) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): nn.Linear(4, 4, device="meta") for i in range(n_layers)})
    return model


def resolved(schedule: str, pp: int, n_layers: int, microbatches: int | None = None) -> PipelineConfig:
    model = tiny_model(n_layers)
    return PipelineConfig.resolve(
        model,
        protocol_anatomy(model),
        pp,
        schedule=schedule,
        microbatches=microbatches,
        virtual_stages=None,
        activation_checkpoint="never",
        layers_per_stage=None,
        stage_balance="layers",
        end_weight=0.0,
    )


def least_microbatches(rule: str, pp: int) -> int:
    """What a documented microbatch rule says is the fewest, read independently of the catalog's code."""
    if rule == "any count":
        return 1
    match = re.fullmatch(r"at least (?:(\d+)\*)?pp", rule)
    assert match, rule
    return int(match.group(1) or 1) * pp


def expected_virtual_stages(rule: str, pp: int, n_layers: int) -> int:
    """What a documented rule says, read independently of the catalog's code."""
    depth = re.fullmatch(r"(\d+) when pp > (\d+) and the model has at least (\d+)\*pp layers, else (\d+)", rule)
    if depth:
        deep, least_pp, factor, shallow = map(int, depth.groups())
        return deep if pp > least_pp and n_layers >= factor * pp else shallow
    return int(re.match(r"\d+", rule).group(0))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_is_documented_with_its_defaults(name):
    spec = SCHEDULES[name]
    line = rf"{spec.virtual_stages_rule}; microbatches {spec.microbatches_rule}"
    docstring = flat(inspect.getdoc(parallelize))
    assert re.search(rf'"{name}"[^:]*: virtual_stages {re.escape(line)}\.', docstring), (name, docstring)
    assert f'"{name}"' in docstring_arg("schedule")
    row = table_row("pipeline.md", f"`{name}`")
    assert row.endswith(f"| {spec.virtual_stages_rule} | {spec.microbatches_rule} |"), row
    assert f'`"{name}"`' in table_row("pipeline.md", "`schedule`")
    assert name in flag_choices("--schedule")


def test_no_other_schedule_is_documented():
    assert flag_choices("--schedule") == set(SCHEDULES)
    assert quoted(table_row("pipeline.md", "`schedule`")) == set(SCHEDULES)
    listed = re.findall(
        r"^\| `(\w+)`[^|]*\|[^|]*\| [^|]+ \| (?:any count|at least (?:\d\*)?pp) \|$",
        (DOCS / "pipeline.md").read_text(),
        re.M,
    )
    assert sorted(listed) == sorted(SCHEDULES)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_documented_defaults_are_what_parallelize_picks(name):
    spec = SCHEDULES[name]
    for pp, n_layers in ((2, 8), (2, 3), (1, 4)):
        if expected_virtual_stages(spec.virtual_stages_rule, pp, n_layers) * pp > n_layers:
            continue  # more stages than layers: refused, whatever the default
        least = least_microbatches(spec.microbatches_rule, pp)
        assert DEFAULT_MICROBATCHES == "pp"
        if least > pp:  # the default (pp) is too few: refused, naming the minimum
            with pytest.raises(ValueError, match=rf"use at least {least} microbatches"):
                resolved(name, pp, n_layers)
        else:
            assert resolved(name, pp, n_layers).schedule.microbatches == pp
        config = resolved(name, pp, n_layers, microbatches=max(least, pp))
        assert config.schedule.virtual_stages == expected_virtual_stages(spec.virtual_stages_rule, pp, n_layers)
    pp = 2
    v = SCHEDULES[name].default_virtual_stages or 1
    build_schedule(name, pp, least_microbatches(spec.microbatches_rule, pp), v)
    fewer = least_microbatches(spec.microbatches_rule, pp) - 1
    if fewer > 0:
        rule = spec.microbatches_rule.replace("at least ", "microbatches >= ")
        with pytest.raises(ValueError, match=re.escape(rule)):
            build_schedule(name, pp, fewer, v)


def test_the_default_schedule_is_marked_where_the_schedules_are_listed():
    default = DEFAULTS["schedule"]
    assert default in SCHEDULES
    assert re.findall(r'"(\w+)" \(default\)', docstring_arg("schedule")) == [default]
    pipeline = (DOCS / "pipeline.md").read_text()
    assert re.findall(r"^\| `(\w+)` \(default\) \|", pipeline, re.M) == [default]
    assert re.findall(r'`"(\w+)"` \(default\)', table_row("pipeline.md", "`schedule`")) == [default]


def test_default_microbatches_is_documented():
    assert DEFAULTS["microbatches"] is None  # resolved to pp (checked above)
    assert f"default {DEFAULT_MICROBATCHES}." in docstring_arg("microbatches")
    assert f"default `{DEFAULT_MICROBATCHES}`" in table_row("pipeline.md", "`microbatches`")
    assert f"`--microbatches` (per step and dp rank; default {DEFAULT_MICROBATCHES})" in flat(
        (DOCS / "training.md").read_text()
    )


@pytest.mark.parametrize(
    "argument, modes, doc, flag",
    [
        ("activation_checkpoint", ACTIVATION_CHECKPOINT_MODES, "pipeline.md", "--activation-checkpoint"),
        ("dp_mode", DP_MODES, "parallelize.md", "--dp-mode"),
    ],
)
def test_modes_and_their_default_are_documented(argument, modes, doc, flag):
    default = DEFAULTS[argument]
    assert default in modes
    text = docstring_arg(argument)
    assert quoted(text) == set(modes), text
    assert re.search(rf'"{default}" \(default', text), text
    row = table_row(doc, f"`{argument}`")
    assert quoted(row) == set(modes), row
    assert f'`"{default}"` (default' in row, row
    assert flag_choices(flag) == set(modes)


def test_the_documented_modes_are_the_ones_accepted():
    """The lists above are the ones the checks use: a mode outside them is refused."""
    with pytest.raises(ValueError, match="activation_checkpoint"):
        PipelineConfig.resolve(
            tiny_model(2),
            protocol_anatomy(tiny_model(2)),
            1,
            schedule="gpipe",
            microbatches=None,
            virtual_stages=None,
            activation_checkpoint="sometimes",
            layers_per_stage=None,
            stage_balance="layers",
            end_weight=0.0,
        )
    from mesh3d.data_parallel.mixed_precision import MixedPrecision
    from mesh3d.data_parallel.wrap import DataParallelConfig

    precision = MixedPrecision.resolve(tiny_model(1), None, torch.float32)
    for mode in DP_MODES:
        DataParallelConfig.resolve(mode, None, 1, 2, precision, 2 if mode == "hsdp" else None)
    with pytest.raises(ValueError, match="dp_mode"):
        DataParallelConfig.resolve("zero3", None, 1, 2, precision)
