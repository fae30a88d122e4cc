"""GPipe and the 1F1B family as schedule generators: the order of compute on each pp rank.

Each returns a `Schedule` (see `ir.py`); `zero_bubble.py` holds the split-backward family and
`catalog.py` names them all.
"""

from __future__ import annotations

from mesh3d.pipeline.schedule.ir import Action, Kind, Schedule


def gpipe(pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """All forwards, then all backwards: simple, but every microbatch's activations are live at once."""
    actions = []
    for rank in range(pp):
        forwards = [Action(rank, Kind.F, j) for j in range(microbatches)]
        backwards = [Action(rank, Kind.B, j) for j in range(microbatches)]
        actions.append(tuple(forwards + backwards))
    return Schedule("gpipe", pp, microbatches, 1, tuple(actions))


def one_f_one_b(pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): pp-1-r warm-up forwards, then alternate, so at most pp activations are live."""
    actions = []
    for rank in range(pp):
        forwards = [Action(rank, Kind.F, j) for j in range(microbatches)]
        backwards = [Action(rank, Kind.B, j) for j in range(microbatches)]
        actions.append(tuple(_one_forward_one_backward(forwards, backwards, warmup=pp - 1 - rank)))
    return Schedule("1f1b", pp, microbatches, 1, tuple(actions))


def interleaved_one_f_one_b(pp: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B, for any microbatches >= pp.

    Microbatches go through each rank's chunks in rounds: a round is a group of >= pp
    consecutive microbatches that passes chunk 0, then chunk 1, ... (backwards in the reverse
    chunk order). With m a multiple of pp every round holds pp microbatches (Megatron's
    schedule); otherwise the m // pp rounds share the remainder, the first rounds one extra each.
    Rank r warms up with (v-1)*g + 2*(pp-1-r) forwards (g: the first round's size), then
    alternates one forward and one backward.
    """
    v = virtual_stages
    rounds = microbatches // pp
    sizes = [microbatches // rounds + (1 if k < microbatches % rounds else 0) for k in range(rounds)]
    actions = []
    for rank in range(pp):
        forwards: list[Action] = []
        backwards: list[Action] = []
        first = 0
        for size in sizes:
            batch = range(first, first + size)
            forwards += [Action(chunk * pp + rank, Kind.F, j) for chunk in range(v) for j in batch]
            backwards += [Action(chunk * pp + rank, Kind.B, j) for chunk in reversed(range(v)) for j in batch]
            first += size
        warmup = (v - 1) * sizes[0] + 2 * (pp - 1 - rank)
        actions.append(tuple(_one_forward_one_backward(forwards, backwards, warmup)))
    return Schedule("interleaved_1f1b", pp, microbatches, v, tuple(actions))


def _one_forward_one_backward(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        order += [forward, backward]
    order += backwards[len(forwards) - warmup :]
    return order
