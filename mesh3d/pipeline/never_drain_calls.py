"""The call lifecycle of a never-drain schedule (schedule/never_drain.py) on this rank.

Each `pm.step` is one call: its batch's forwards, the backwards the stream puts in this call (some
of the previous call's), and the updates they complete (weight_versions.py). One `StageCompute`
(stage_compute.py) lives from the first call to the flush, carrying the backwards and messages a
call leaves to the next; microbatches are numbered across calls. A call that raises half-way
leaves the weight versions out of step with the update rule: every later call is refused until a
checkpoint replaces them.

What a checkpoint keeps of it (checkpoint/kept_versions.py) comes and goes through `state_dict`
and `load_state_dict`, as torch's Stateful protocol has it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mesh3d.distributed.shards import local_tensor
from mesh3d.pipeline.routes import MessageSpec
from mesh3d.pipeline.schedule.ir import Action
from mesh3d.pipeline.schedule.never_drain import NeverDrainStream, UpdateRule
from mesh3d.pipeline.stage_compute import MicrobatchLoss, RuntimeCounters, StageCompute
from mesh3d.pipeline.weight_versions import WeightVersions


class NeverDrainCalls:
    """This rank's never-drain calls: the stream's action lists, the step in flight between
    calls, and the weight versions the calls use and update.

    Args:
        stream: the schedule's calls, cut per call.
        versions: the weight versions and the updates (built over the stages and the optimizer).
        pp_rank: this rank in the pipeline (whose action lists it runs).
        stages: this rank's stage modules, by stage index (their parameters' names name the kept
            versions in `state_dict`).
    """

    def __init__(
        self, stream: NeverDrainStream, versions: WeightVersions | None, pp_rank: int, stages: dict[int, nn.Module]
    ):
        self.stream = stream
        self.versions = versions
        self.pp_rank = pp_rank
        self.stages = stages
        self.in_flight: StageCompute | None = None  # the calls whose backwards are not all done
        self.calls = 0  # calls run so far (microbatches are numbered across them)
        self.last_call_behind = False  # whether the last call ran behind another still in flight
        self.failed: str | None = None  # a call that raised half-way (what it was)
        self.counters = RuntimeCounters()  # the last call's (a flush's traffic counts to them)

    def call(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        specs: dict[tuple[int, int], MessageSpec],
        loss: MicrobatchLoss,
        counters: RuntimeCounters,
        start: Callable[[], StageCompute],
        per_sample: Sequence[dict[str, torch.Tensor]] = (),
    ) -> torch.Tensor:
        """One call on this batch's microbatches (`start` builds the step when nothing is in
        flight); returns [sum of the loss values, sum of their counts, sum of the router terms] computed here."""
        m = self.stream.rule.microbatches
        self._refuse_after_failure()
        if self.in_flight is not None and self.in_flight.specs != specs:
            self.flush()  # new boundary shapes: the messages in flight were sized for the old ones
        behind = self.in_flight is not None
        if not behind:
            self.in_flight = start()
        step = self.in_flight
        self.counters = counters
        first = self.calls * m
        # What the previous call left in flight stays; this call's batch, loss and counters join it.
        step.inputs, step.targets, step.loss = dict(enumerate(inputs, first)), dict(enumerate(targets, first)), loss
        # the previous call's stay for the backwards (and their recomputes) it left in flight
        kept = {mb: inputs for mb, inputs in dict(step.per_sample).items() if mb >= first - m}
        step.per_sample = kept | dict(enumerate(per_sample, first))
        step.counters = step.mailbox.traffic = counters
        counters.live_activations = counters.peak_live_activations = len(step.saved)
        self.versions.begin_call(self.calls)
        actions = self.stream.call(self.pp_rank, self.calls, behind)
        self.calls += 1
        self.last_call_behind = behind
        return self._execute(step, actions, f"call {self.calls - 1}")

    def _execute(self, step: StageCompute, actions: tuple[Action, ...], what: str) -> torch.Tensor:
        try:
            for action in actions:
                step.execute(action, is_last_backward=False)  # a never-drain step asks its update rule
            totals = step.finish()  # its sends done, its losses summed
            step.losses, step.counts, step.router_terms = [], [], []
            return totals
        except BaseException as error:
            self.mark_failed(f"{what} raised {type(error).__name__}")
            raise

    def flush(self) -> None:
        """Finish every backward and update still in flight, then put each stage's newest weights
        in its parameters."""
        self._refuse_after_failure()
        if self.in_flight is not None:
            step, self.in_flight = self.in_flight, None
            step.counters = step.mailbox.traffic = self.counters  # the flush's traffic counts to the last call
            self._execute(step, self.stream.flush(self.pp_rank, self.calls - 1, self.last_call_behind), "flush")
        self.versions.settle()

    def mark_failed(self, what: str) -> None:
        """A never-drain call (or its closing loss) raised: part of its updates ran, and the weight
        versions and the work in flight are out of step with the rule; nothing can continue it
        exactly but a checkpoint (`discard_in_flight` once one is loaded)."""
        self.in_flight = None
        self.failed = self.failed or what
        self.versions.drop_pending()

    @contextlib.contextmanager
    def failure_marked(self, cleanup: Callable[[], None]) -> Iterator[None]:
        """Around a call and its closing loss: if either raises (here, or a peer's failure seen
        here), part of the call's updates ran, so `cleanup` drops what it left outside the pipeline
        and every later call is refused (every rank marks it, whichever raised first)."""
        try:
            yield
        except BaseException as error:
            cleanup()
            self.mark_failed(f"call {self.calls - 1} raised {type(error).__name__}")
            raise

    def _refuse_after_failure(self) -> None:
        if self.failed is not None:
            raise RuntimeError(
                f"a never-drain {self.failed} half-way through the pipeline: the weights, their kept versions and "
                "the updates in flight no longer follow the update rule; load a checkpoint (mesh3d.checkpoint.load) "
                "to continue (with pp > 1: restart the processes and resume from one)"
            )

    def discard_in_flight(self) -> None:
        """Before weights are replaced (a checkpoint, a state dict): what the calls left in flight is
        dropped (tied copies' gradients waiting for a TIE too), and any earlier failure forgotten.
        No message is pending between calls (each call receives everything it sends), so this needs
        no communication; ParallelModel.discard_in_flight drops data parallelism's part (and refuses
        after a failure with pipeline ranks: the messages the failed call left posted cannot be
        withdrawn)."""
        self.in_flight, self.failed, self.last_call_behind = None, None, False
        self.versions.drop_pending()

    def restart_rule(self) -> None:
        """After weights were replaced from outside the rule (a full state dict, safetensors, a
        checkpoint of a schedule that drains): the update rule starts afresh from them, as at the
        first call (their one version is all there is)."""
        self.discard_in_flight()
        self.calls = 0
        self.versions.restore(0, 0, {})

    # -- the state a checkpoint keeps (torch's Stateful protocol) -------------------------------

    @property
    def rule(self) -> UpdateRule:
        """The schedule's update rule: which weight version each microbatch uses."""
        return self.stream.rule

    def state_dict(self) -> dict:
        """Where the update rule stands and the weight versions it still names, after a flush:
        {"rule": {"schedule", "pp", "microbatches", "calls", "updates"}, "versions":
        {"<v>.<name>": parameter <name> (the unsplit model's) after <v> updates, this rank's shard
        placed as the parameter is}}."""
        rule, names = self.rule, self._names()
        versions: dict[str, torch.Tensor] = {}
        for weights in self.versions.groups():
            for version, copies in weights.kept.items():
                for param, local in zip(weights.params, copies):
                    versions.setdefault(f"{version}.{names[id(param)]}", _like(param, local))
        return {
            "rule": {
                "schedule": rule.schedule,
                "pp": rule.pp,
                "microbatches": rule.microbatches,
                "calls": self.calls,
                "updates": self.versions.updates(),
            },
            "versions": versions,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`, as `state_dict` gave it ("versions" holds at least what
        `kept_names(state["rule"])` names); its rule None (a checkpoint of a schedule that drains):
        the rule starts afresh from the weights in the parameters (`restart_rule`)."""
        saved = state["rule"]
        if saved is None:
            self.restart_rule()
            return
        next_microbatch, names = self._next_microbatch(saved), self._names()
        kept: dict[int, dict[int, list[torch.Tensor]]] = {}
        for position, (weights, needed) in enumerate(self.versions.needed_versions(next_microbatch, saved["updates"])):
            kept[position] = {
                version: [local_tensor(state["versions"][f"{version}.{names[id(p)]}"]).clone() for p in weights.params]
                for version in needed
            }
        self.calls = saved["calls"]
        self.versions.restore(next_microbatch, saved["updates"], kept)

    def kept_names(self, saved: dict) -> list[str]:
        """The "versions" entries of a state saved at rule state `saved` that this rank continues from."""
        return list(self._kept_params(saved))

    def empty_versions(self, saved: dict) -> dict[str, torch.Tensor]:
        """`kept_names(saved)` with empty tensors shaped and placed as the parameters, to fill."""
        return {name: torch.empty_like(param.detach()) for name, param in self._kept_params(saved).items()}

    def _kept_params(self, saved: dict) -> dict[str, nn.Parameter]:
        params: dict[str, nn.Parameter] = {}
        names = self._names()
        for weights, needed in self.versions.needed_versions(self._next_microbatch(saved), saved["updates"]):
            for version in needed:
                for param in weights.params:
                    params.setdefault(f"{version}.{names[id(param)]}", param)
        return params

    def _names(self) -> dict[int, str]:
        """By id: each parameter's name in the unsplit model (its first)."""
        names: dict[int, str] = {}
        for index in sorted(self.stages):
            for name, param in self.stages[index].named_parameters():
                names.setdefault(id(param), name)
        return names

    def _next_microbatch(self, saved: dict) -> int:
        """Microbatches are numbered across calls; a batch-level rule (2BW) renumbers by the calls made."""
        return saved["calls"] * self.rule.microbatches


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a shard) as the parameter holds its own: a DTensor with its mesh and placements."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
        )
    return local
