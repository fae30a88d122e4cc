"""A configuration error, said once and in the user's terms: flags, not Python parameters.

mesh3d raises a configuration error (a ValueError, TypeError or FileNotFoundError: a schedule that needs more
microbatches, sizes that do not divide, a checkpoint that is not there) on every rank, before
any collective, naming its parameters (`schedule='gpipe'`, `microbatches=1`). Under torchrun that
is one traceback per process. `reported_once` prints it on rank 0 alone, with each parameter
that is also a flag written as the flag the user typed (`--schedule gpipe`, `--microbatches 1`),
then exits with status 2 on every rank, without a traceback. Messages train.py raises itself
(SystemExit with a text) already speak in flags and are printed as they are, on rank 0.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from examples.llama.arguments import is_rank_zero

# Library parameters whose flag has another name than the parameter.
ALIASES = {"global_batch_size": "--global-batch", "dp_size": "--dp", "dtype": "--token-dtype"}

# Ranks other than 0 wait this long before exiting: torchrun stops every worker as soon as one
# fails, and must not stop rank 0 before it has printed the message.
GRACE_S = 2.0

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
        notes = "".join(f"\n{note}" for note in getattr(error, "__notes__", ()))  # e.g. which flag sets a parameter
        _exit(f"error: {in_user_terms(str(error), flags)}{notes}")
    except SystemExit as done:
        if not isinstance(done.code, str):
            raise  # argparse's exit (its message printed by rank 0 already), or a plain status
        _exit(done.code)


def _exit(message: str) -> None:
    if is_rank_zero():
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(GRACE_S)
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(2)
