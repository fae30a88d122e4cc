"""`--config-file run.toml`: any train.py flag under its long name with underscores, kept in version control.

    # run.toml
    global_batch = 16
    seq_len = 256
    data = ["corpus/*.jsonl"]
    tokenizer = "tokenizer.json"
    loss_parallel = true

The file's settings become command-line arguments placed before the real ones, so argparse checks
their types and choices exactly as it checks typed flags, and a flag given on the command line
overrides the file (argparse keeps the last occurrence). A key that names no flag is an error that
lists the valid ones.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import tomllib

CONFIG_FILE_FLAG = "--config-file"


def config_file_argv(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The arguments of the `--config-file` named in `argv` (none if it names none), for `parser`."""
    finder = argparse.ArgumentParser(add_help=False)
    finder.add_argument(CONFIG_FILE_FLAG, default=None)
    path = finder.parse_known_args(argv)[0].config_file
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            settings = tomllib.load(f)
    except FileNotFoundError:
        parser.error(f"{CONFIG_FILE_FLAG} {path}: no such file")
    except tomllib.TOMLDecodeError as e:
        parser.error(f"{CONFIG_FILE_FLAG} {path}: not valid TOML ({e})")
    return settings_to_argv(parser, settings, source=str(path))


def settings_to_argv(parser: argparse.ArgumentParser, settings: dict, source: str = "the config file") -> list[str]:
    """`{"global_batch": 16, "tied": false}` -> `["--global-batch", "16", "--no-tied"]` for this parser's flags."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config_file")}
    argv: list[str] = []
    for key, value in settings.items():
        action = actions.get(key)
        if action is None:
            raise_unknown(parser, key, sorted(actions), source)
        flag = next(s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-"))
        if isinstance(action, argparse.BooleanOptionalAction):
            _expect(parser, source, key, value, bool)
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            _expect(parser, source, key, value, bool)
            if value == isinstance(action, argparse._StoreTrueAction):
                argv.append(flag)
        elif action.nargs in ("*", "+"):
            values = value if isinstance(value, list) else [value]
            argv += [flag, *map(str, values)]
        else:
            if isinstance(value, (list, dict)):
                parser.error(f"{source}: {key} takes one value, got {value!r}")
            argv.append(f"{flag}={str(value).lower() if isinstance(value, bool) else value}")
    return argv


def raise_unknown(parser: argparse.ArgumentParser, key: str, valid: list[str], source: str) -> None:
    parser.error(f"{source}: unknown setting {key!r}; valid settings are: {', '.join(valid)}")


def _expect(parser: argparse.ArgumentParser, source: str, key: str, value, kind: type) -> None:
    if not isinstance(value, kind):
        parser.error(f"{source}: {key} must be {kind.__name__} (true or false), got {value!r}")


def effective_config_toml(args: argparse.Namespace, defaults: argparse.Namespace | None = None) -> str:
    """The settings a run used, as TOML that `--config-file` reads back (unset ones left out); with
    `defaults` (what no flag gives), only those that differ from them: the same run, read back."""
    lines = []
    default_of = vars(defaults) if defaults is not None else {}
    for key, value in sorted(vars(args).items()):
        if value is None or key == "config_file" or (key in default_of and default_of[key] == value):
            continue
        lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines)


def args_as_record(args: argparse.Namespace) -> dict:
    """The arguments as JSON takes them (what a checkpoint keeps): a parsed value of its own type
    (--profile-steps' StepWindow) as the text its flag reads back."""
    plain = (str, int, float, bool, list, dict, type(None))
    return {key: value if isinstance(value, plain) else str(value) for key, value in vars(args).items()}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Path):
        value = str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
