"""`--config-file run.toml` parsed in this process: flags under their long names with underscores, the
command line on top, unknown keys refused with the valid ones listed, the effective config read back as the
same run. (train.py printing and checkpointing it: tests/distributed/test_run_config.py.)"""

import re

import pytest
import tomllib

from examples.llama.run_config import effective_config_toml
from examples.llama.train import parse_args

RUN_TOML = """
global_batch = 32
steps = 3
lr = 1e-3
data = ["a.jsonl", "shards/*.parquet"]
tied = false
loss_parallel = true
schedule = "1f1b"
"""


def test_file_then_command_line(tmp_path):
    (tmp_path / "run.toml").write_text(RUN_TOML)
    args = parse_args(["--config-file", str(tmp_path / "run.toml"), "--steps", "5", "--tied", "--data", "b.txt"])
    assert (args.global_batch, args.lr, args.loss_parallel, args.schedule) == (32, 1e-3, True, "1f1b")
    assert (args.steps, args.tied, args.data) == (5, True, ["b.txt"])  # the command line wins
    assert parse_args(["--config-file", str(tmp_path / "run.toml")]).data == ["a.jsonl", "shards/*.parquet"]
    defaults = parse_args([])
    assert (defaults.global_batch, defaults.tied, defaults.loss_parallel) == (16, None, False)


def test_the_effective_config_reads_back_as_the_same_run(tmp_path):
    (tmp_path / "run.toml").write_text(RUN_TOML)
    args = parse_args(["--config-file", str(tmp_path / "run.toml"), "--seed", "4"])
    saved = effective_config_toml(args)
    assert tomllib.loads(saved)["seed"] == 4 and "config_file" not in tomllib.loads(saved)
    (tmp_path / "effective.toml").write_text(saved)
    assert vars(parse_args(["--config-file", str(tmp_path / "effective.toml")])) == {
        **vars(args),
        "config_file": str(tmp_path / "effective.toml"),
    }
    # What train.py prints: the settings that differ from the defaults, the same run read back.
    short = tomllib.loads(effective_config_toml(args, parse_args([])))
    given = {"global_batch", "steps", "lr", "data", "tied", "loss_parallel", "schedule", "seed"}
    assert given <= set(short) and len(short) < len(tomllib.loads(saved)) / 2, sorted(short)
    (tmp_path / "short.toml").write_text(effective_config_toml(args, parse_args([])))
    assert vars(parse_args(["--config-file", str(tmp_path / "short.toml")])) == {
        **vars(args),
        "config_file": str(tmp_path / "short.toml"),
    }


@pytest.mark.parametrize(
    "toml, message",
    [
        ("global_bach = 8", "unknown setting 'global_bach'; valid settings are: .*global_batch"),
        ('steps = "many"', "argument --steps: invalid int value: 'many'"),
        ('schedule = "zigzag"', "argument --schedule: invalid choice: 'zigzag'"),
        ("loss_parallel = 1", "loss_parallel must be bool"),
        ("steps = [1, 2]", "steps takes one value"),
        ("steps = ", "not valid TOML"),
    ],
)
def test_bad_settings_name_the_problem(tmp_path, capsys, toml, message):
    (tmp_path / "run.toml").write_text(toml)
    with pytest.raises(SystemExit):
        parse_args(["--config-file", str(tmp_path / "run.toml")])
    assert re.search(message, capsys.readouterr().err)


def test_the_grad_clip_default_follows_the_schedule(tmp_path):
    """1.0 where a step drains; off with a never-drain schedule (no whole gradient), whose effective
    config (grad_clip = 0.0) reads back as the same run; an explicit clip with it is refused."""
    assert parse_args([]).grad_clip == 1.0 and parse_args(["--grad-clip", "0.5"]).grad_clip == 0.5
    args = parse_args(["--schedule", "pipedream", "--pp", "2"])
    assert args.grad_clip == 0.0 and parse_args(["--schedule", "pipedream", "--grad-clip", "0"]).grad_clip == 0.0
    (tmp_path / "effective.toml").write_text(effective_config_toml(args))
    assert vars(parse_args(["--config-file", str(tmp_path / "effective.toml")])) == {
        **vars(args),
        "config_file": str(tmp_path / "effective.toml"),
    }
    (tmp_path / "clip.toml").write_text("grad_clip = 1.0")
    with pytest.raises(SystemExit):
        parse_args(["--config-file", str(tmp_path / "clip.toml"), "--schedule", "pipedream"])
