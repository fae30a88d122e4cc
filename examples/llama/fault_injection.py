"""A test hook: make one worker fail at a chosen point, so fault tests are deterministic.

Off unless the environment variable MESH3D_FAULT is set. Its value is `ACTION@RANK:PHASE:STEP`:

    kill@1:step:6    rank 1 SIGKILLs itself inside the pipelined step 6 (in its first stage's
                     forward, while its pipeline peers wait for its messages)
    kill@0:save:4    rank 0 SIGKILLs itself inside the save of the step-4 checkpoint, after every
                     shard is written and before the checkpoint is published under its name
                     (with --async-checkpoint in the background write, training having gone on)
    stop@1:step:2    rank 1 SIGSTOPs itself inside step 2 (a hang: it never answers again)
    hang@1:step:2    rank 1 sleeps forever inside step 2 (a hang that SIGTERM still ends)

It fires only in torchrun's first attempt (TORCHELASTIC_RESTART_COUNT 0 or unset), so the
restarted workers run clean. Steps count from 1, as in the metrics file.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ENV = "MESH3D_FAULT"
_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "hang": None}
_PHASES = ("step", "save")


@dataclass
class FaultInjection:
    """The fault this rank must suffer, if any; `arm` it on the model, `at_step` it every step, pass
    `before_publish(step)` to checkpoint.save."""

    signal: signal.Signals | None  # None: an endless loop
    phase: str
    step: int
    current_step: int = 0

    @classmethod
    def from_env(cls, rank: int) -> FaultInjection | None:
        """This rank's fault from MESH3D_FAULT, or None (not set, another rank's, or a restart)."""
        spec = os.environ.get(ENV)
        if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            return None
        try:
            action, where = spec.split("@")
            target_rank, phase, step = where.split(":")
            fault = cls(_SIGNALS[action], phase, int(step))
            if phase not in _PHASES:
                raise KeyError(phase)
        except (ValueError, KeyError):
            raise SystemExit(
                f"{ENV}={spec!r}: expected ACTION@RANK:PHASE:STEP, ACTION in {sorted(_SIGNALS)}, PHASE in {_PHASES}"
            ) from None
        return fault if int(target_rank) == rank else None

    def arm(self, pm) -> None:
        """Install a "step" fault: a forward pre-hook on this rank's first stage. A "save" fault
        fires through `before_publish`, which the loop passes to mesh3d.checkpoint.save."""
        if self.phase == "step":
            first_stage = pm.stages[min(pm.stages)]
            first_stage.register_forward_pre_hook(lambda module, args: self._fire_at(self.step))

    def before_publish(self, saved_step: int) -> Callable[[Path], None]:
        """checkpoint.save's hook for the checkpoint of `saved_step`: every shard of it is written,
        none published yet. It fires by the step saved, not the loop's: an async save's hook runs
        in its background thread while the loop has gone on."""

        def hook(written: Path) -> None:
            if self.phase == "save" and saved_step == self.step:
                self._fire()

        return hook

    def at_step(self, step: int) -> None:
        """The training loop is at `step` (counted from 1)."""
        self.current_step = step

    def _fire_at(self, step: int) -> None:
        if self.current_step == step:
            self._fire()

    def _fire(self) -> None:
        if self.signal is None:
            while True:
                time.sleep(1)
        os.kill(os.getpid(), self.signal)
