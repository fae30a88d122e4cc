"""Errors on every rank: the shape of the tests that give each rank bad input and want the same clear
error everywhere, with no rank left waiting.

On each rank (inside a function given to `run_on_ranks`), `raised(call)`, `message_of(call)` or
`messages_of(cases)` runs the calls and keeps what they raised; after each call every rank meets in
a barrier. A rank that had started a collective before raising would pair with another rank's
barrier instead, and the launch would hang, which `run_on_ranks` turns into a failure within
seconds. In the test, `assert_raised_on_every_rank(per_rank, expected)` checks every rank's messages.
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, Sequence, TypeVar

import torch.distributed as dist

Case = TypeVar("Case", bound=Hashable)


def raised(call: Callable[[], object], errors: tuple[type[BaseException], ...] = (ValueError,)) -> BaseException | None:
    """Call `call()` on this rank and return the error it raised (one of `errors`), or None; then wait in
    a barrier for every rank. Any other exception propagates (after the barrier)."""
    try:
        call()
    except errors as error:
        return error
    finally:
        dist.barrier()
    return None


def message_of(call: Callable[[], object], errors: tuple[type[BaseException], ...] = (ValueError,)) -> str | None:
    """`raised`, as "ErrorType: message", or None where the call raised nothing."""
    error = raised(call, errors)
    return None if error is None else f"{type(error).__name__}: {error}"


def messages_of(
    cases: Mapping[Case, Callable[[], object]], errors: tuple[type[BaseException], ...] = (ValueError,)
) -> dict[Case, str | None]:
    """`message_of` for each case, in order (every rank must list the same cases in the same order)."""
    return {name: message_of(call, errors) for name, call in cases.items()}


def assert_raised_on_every_rank(
    per_rank: Sequence[Mapping[Case, str | None]], expected: Mapping[Case, str], error_type: str = "ValueError"
) -> None:
    """Every rank's message for each case of `expected` exists, is an `error_type`, and contains the
    expected text. Cases not in `expected` are left to the caller."""
    for rank, messages in enumerate(per_rank):
        for name, text in expected.items():
            message = messages[name]
            assert message is not None, f"rank {rank}: {name} did not raise"
            assert message.startswith(f"{error_type}: "), (rank, name, message)
            assert text in message, f"rank {rank}: {name}: {message}"
