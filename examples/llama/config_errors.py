"""A configuration error, said once and in the user's terms: flags, not Python parameters.

mesh3d raises a configuration error (a ValueError, TypeError or FileNotFoundError: a schedule that needs more
microbatches, sizes that do not divide, a checkpoint that is not there) on every rank, before
any collective, naming its parameters (`schedule='gpipe'`, `microbatches=1`). Under torchrun that
is one traceback per process. `reported_once` prints it on rank 0 alone, with each parameter
that is also a flag written as the flag the user typed (`--schedule gpipe`, `--microbatches 1`),
then exits with status 2 on every rank, without a traceback, the ranks leaving together
(exit_together.py: under torchrun no rank is stopped by SIGTERM on its way out). Messages train.py
raises itself (SystemExit with a text) already speak in flags and are printed as they are, on rank
0; argparse's (printed by rank 0, parser.error) leave together too. `agreed_errors_said_once` does
the same, for the whole run, with a ValueError or TypeError mesh3d raised on every rank alike (a bad
token id pm.step found): a user's error, not a crash, so no traceback either.
"""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from examples.llama.arguments import build_parser
from examples.llama.exit_together import exit_together
from mesh3d.distributed.printed_once import AGREED

# Library parameters whose flag has another name than the parameter.
ALIASES = {"global_batch_size": "--global-batch", "dp_size": "--dp", "dtype": "--token-dtype"}

Main = TypeVar("Main", bound=Callable)

_VALUE = r"'[^']*'|\"[^\"]*\"|[^\s,;)\]]+"


def flags_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{parameter name: its flag}: every long flag of the parser under its destination, plus ALIASES."""
    flags = {
        a.dest: next(s for s in a.option_strings if s.startswith("--"))
        for a in parser._actions
        if any(s.startswith("--") for s in a.option_strings) and a.dest != "help"
    }
    return {**flags, **ALIASES}


def in_user_terms(message: str, flags: dict[str, str]) -> str:
    """`schedule='gpipe'` -> `--schedule gpipe`, `loss_parallel=True` -> `--loss-parallel`, for known names."""
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))

    def flag(match: re.Match) -> str:
        name, value = match.group(1), match.group(2).strip("'\"")
        if value == "True":
            return flags[name]
        if value in ("False", "None"):
            return f"no {flags[name]}"
        return f"{flags[name]} {value}"

    return re.sub(rf"(?<![\w*.\-])({names})=({_VALUE})", flag, message)


@contextmanager
def reported_once(flags: dict[str, str]) -> Iterator[None]:
    """Run the set-up; a configuration error is printed by rank 0 and every rank exits with status 2."""
    try:
        yield
    except (ValueError, TypeError, FileNotFoundError) as error:  # FileNotFoundError: a --data path that is not there
        exit_together(_error_line(error, flags))
    except SystemExit as done:
        if isinstance(done.code, str):
            exit_together(done.code)
        if done.code == 2:  # argparse's error, its message printed by rank 0 already
            exit_together(None)
        raise  # --help's exit, or another plain status


def agreed_errors_said_once(main: Main) -> Main:
    """`main`, with a ValueError or TypeError that mesh3d raised on every rank alike (marked agreed:
    a bad batch at a step) printed once in train.py's `error:` form, every rank exiting with status 2."""

    @functools.wraps(main)
    def said_once(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (ValueError, TypeError) as error:
            if not getattr(error, AGREED, False):
                raise  # a bug's error: its traceback, on every rank
            exit_together(_error_line(error, flags_of(build_parser())))

    return said_once


def _error_line(error: BaseException, flags: dict[str, str]) -> str:
    notes = "".join(f"\n{note}" for note in getattr(error, "__notes__", ()))  # e.g. which flag sets a parameter
    return f"error: {in_user_terms(str(error), flags)}{notes}"
