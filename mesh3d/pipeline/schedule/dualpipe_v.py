"""DualPipeV: DeepSeek's DualPipe "cut in half" into a V, in the order torch's ScheduleDualPipeV lists it.

DualPipe (DeepSeek-V3 technical report, arXiv 2412.19437) feeds microbatches into both ends of
the pipeline at once, each rank holding two copies of the model's stages. DualPipeV folds it into
one V: rank r holds stages r (its "down" stage, on the way out) and 2*pp-1-r (its "up" stage, on
the way back), mesh3d's "v" placement, so the first and last stage share rank 0, and every
microbatch flows down the ranks and back up. Backwards are split into I (input gradient) and W
(weight gradient) as in `zero_bubble.py`.

Rank r's list, phase by phase (torch 2.13's ScheduleDualPipeV builds the same order, which
tests/unit/test_dualpipe_v.py checks; "backward" alone means an I followed at once by its W):

1. 2*(pp-1-r) forwards of the down stage (warm-up; rank pp-1 has none);
2. r+1 pairs: a down forward, then an up forward;
3. pp-1-r times: I of the up stage, a deferred W (here: that I's own), an up forward;
4. the steady state, m-2*pp+r+1 rounds of two overlapped chunks: (down forward with an up
   backward), then (up forward with a down backward); on the last rank the first round's
   first chunk is a forward then a backward, not overlapped (torch does so to shorten the bubble);
5. pp-1-r times: an up backward, then (up forward with a down backward);
6. r+1 pairs of backwards (up, then down): the first half whole, the second half as I only, its
   W deferred (on odd ranks the split starts one action earlier, at the pair's up backward);
7. pp-1-r times: a deferred W, then a down backward (I only once the split has started);
8. the r+1 deferred W's left, oldest first.

An "overlapped" chunk is torch's OVERLAP_F_B: DualPipe runs the forward of one microbatch and
the backward of another together, so one's communication hides behind the other's compute.
mesh3d runs the two one after the other on one stream: the forward, then the backward (I, W).

Bubble and memory. DeepSeek's DualPipe README (github.com/deepseek-ai/DualPipe, its table of
bubbles) gives DualPipeV's bubble per device as (PP/2 - 1)(F&B + B - 3W), where PP counts
stages (so PP/2 = pp, mesh3d's ranks), F, B and W are one stage's forward, whole backward and
weight-gradient times, and F&B the time of a forward and a backward run overlapped; and its
activations per device as PP + 1 stages' (2*pp + 1). The figure is for DualPipe's way of running
a chunk: an overlapped forward and backward start together, once both inputs are there. Played
that way with F&B = F + B (no gain from the overlap) and F = I = W (F = 1, B = 2, W = 1, the
chunks DeepSeek draws), every rank idles exactly 2*(pp-1); for other splits the figure is an
estimate. mesh3d runs a chunk's forward and then its backward, so the forward no longer waits for
the backward's gradient: simulate() gives (pp-1)*F per rank with F = I = W, half the README's,
the same as zbv; with I costing more than W, as on real blocks, it idles longer than zbv (which
runs each I next to its W) and less than interleaved 1F1B, holding one stage activation more
than zbv. tests/unit/test_dualpipe_v.py checks each of these, and the order against torch's.

torch requires at least as many microbatches as stages (m >= 2*pp): with fewer, step 4's count
goes negative on the first ranks. The catalog enforces the same.
"""

from __future__ import annotations

from collections import deque

from mesh3d.pipeline.schedule.ir import Action, Kind, Schedule, ScheduleError

Chunk = tuple[Action, ...]  # one entry of torch's list: F; I; W; a whole backward (I, W); or F, I, W overlapped


def dualpipe_v(pp: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """DualPipeV's per-rank action lists (see the module docstring); needs microbatches >= 2*pp."""
    if virtual_stages != 2:
        raise ValueError(
            f"schedule 'dualpipev' places exactly 2 stages per rank in a V, got virtual_stages={virtual_stages}; "
            "leave virtual_stages out or pass 2"
        )
    actions = tuple(tuple(a for chunk in chunks for a in chunk) for chunks in dualpipe_v_chunks(pp, microbatches))
    return Schedule("dualpipev", pp, microbatches, 2, actions, placement="v")


def dualpipe_v_chunks(pp: int, microbatches: int) -> tuple[tuple[Chunk, ...], ...]:
    """Per rank, its list as torch's ScheduleDualPipeV groups it: each chunk runs as one step there
    (an overlapped forward and backward together); mesh3d runs a chunk's actions in order."""
    if microbatches < 2 * pp:
        raise ValueError(
            f"schedule 'dualpipev' needs microbatches >= 2*pp (as many as its stages), got microbatches={microbatches} "
            f"with pp={pp}; use at least {2 * pp} microbatches"
        )
    return tuple(tuple(_RankOrder(pp, microbatches, rank).build()) for rank in range(pp))


class _RankOrder:
    """One rank's chunks, built phase by phase; each stage takes its microbatches in order."""

    def __init__(self, pp: int, microbatches: int, rank: int) -> None:
        self.pp, self.m, self.rank = pp, microbatches, rank
        self.down, self.up = rank, 2 * pp - 1 - rank
        self.next_forward = {self.down: 0, self.up: 0}
        self.next_backward = {self.down: 0, self.up: 0}
        self.deferred: deque[Action] = deque()  # W's whose I ran without them, oldest first
        self.chunks: list[Chunk] = []

    def _forward(self, stage: int) -> Chunk:
        j = self.next_forward[stage]
        self.next_forward[stage] += 1
        return (Action(stage, Kind.F, j),)

    def _backward(self, stage: int, defer_weight: bool) -> Chunk:
        """I, then its W at once (a whole backward), or I alone with its W deferred."""
        j = self.next_backward[stage]
        self.next_backward[stage] += 1
        if defer_weight:
            self.deferred.append(Action(stage, Kind.W, j))
            return (Action(stage, Kind.I, j),)
        return Action(stage, Kind.I, j), Action(stage, Kind.W, j)

    def forward(self, stage: int) -> None:
        self.chunks.append(self._forward(stage))

    def backward(self, stage: int, defer_weight: bool = False) -> None:
        self.chunks.append(self._backward(stage, defer_weight))

    def overlapped(self, forward_stage: int, backward_stage: int) -> None:
        """torch's OVERLAP_F_B: a forward and a whole backward of the other stage, as one chunk."""
        self.chunks.append(self._forward(forward_stage) + self._backward(backward_stage, defer_weight=False))

    def deferred_weight(self) -> None:
        """The oldest deferred W, if any (torch skips the step when none waits)."""
        if self.deferred:
            self.chunks.append((self.deferred.popleft(),))

    def build(self) -> list[Chunk]:
        pp, r, down, up = self.pp, self.rank, self.down, self.up
        for _ in range(2 * (pp - 1 - r)):  # 1: warm-up forwards of the down stage
            self.forward(down)
        for _ in range(r + 1):  # 2: down and up forwards in pairs
            self.forward(down)
            self.forward(up)
        for _ in range(pp - 1 - r):  # 3: I, W, F of the up stage
            self.backward(up, defer_weight=True)
            self.deferred_weight()
            self.forward(up)
        for i in range(self.m - 2 * pp + r + 1):  # 4: the steady state, two overlapped chunks a round
            if i == 0 and r == pp - 1:  # not overlapped: shortens the bubble (torch's note)
                self.forward(down)
                self.backward(up)
            else:
                self.overlapped(down, up)
            self.overlapped(up, down)
        for _ in range(pp - 1 - r):  # 5: an up backward, then up forward with a down backward
            self.backward(up)
            self.overlapped(up, down)
        split, half = False, (r + 1) // 2
        for i in range(r + 1):  # 6: backwards in pairs; from the middle on as I alone, W deferred
            split = split or (i == half and r % 2 == 1)
            self.backward(up, defer_weight=split)
            split = split or (i == half and r % 2 == 0)
            self.backward(down, defer_weight=split)
        for _ in range(pp - 1 - r):  # 7: a deferred W, then a down backward
            self.deferred_weight()
            self.backward(down, defer_weight=split)
        for _ in range(r + 1):  # 8: the deferred W's left
            self.deferred_weight()
        self._check_complete()
        return self.chunks

    def _check_complete(self) -> None:
        """Every stage's forwards and backwards listed, no W left deferred (else a bug here)."""
        counts = (*self.next_forward.values(), *self.next_backward.values())
        if any(c != self.m for c in counts) or self.deferred:
            raise ScheduleError(
                f"dualpipev rank {self.rank} (pp={self.pp}, m={self.m}): forwards {self.next_forward}, "
                f"backwards {self.next_backward}, {len(self.deferred)} W's left deferred"
            )
