"""Each step's device scalars kept unread until a logging step reads them all at once.

    unread = UnreadSteps()
    for step in ...:
        loss = pm.step(inputs, targets)                       # on the device, unread
        unread.add(step, loss=loss, grad_norm=norm, skipped=skipped_flag, lr=lr)
        if logging_step:
            for values in unread.read():                      # one host read for every step since the last
                write(values)                                  # {"step", "loss", "grad_norm", "skipped", "lr"}

A read of a device value stops the host until the device has run everything queued before it; a
loop that reads each step's loss keeps the device waiting for the host at every step. Holding
the values (0-dim tensors, a few bytes each) and reading them together on logging steps keeps the
steps between free of any read (torchtitan's rule), and still gives every step its row. Plain
Python values (an lr, a step time) and None pass through as they are; a bool tensor comes back a
bool.
"""

from __future__ import annotations

import torch


class UnreadSteps:
    """Steps' values, their tensors unread until `read` (see the module docstring)."""

    def __init__(self) -> None:
        self._steps: list[tuple[int, dict[str, object]]] = []

    def add(self, step: int, **values: object) -> None:
        """Hold `step`'s values: 0-dim tensors stay unread, anything else is kept as it is."""
        self._steps.append((step, values))

    def __len__(self) -> int:
        return len(self._steps)

    def read(self) -> list[dict[str, object]]:
        """Every held step's values, in order, each {"step": step, name: value}, its tensors read
        in one host read (as Python numbers; bool tensors as bools); forgets them."""
        steps, self._steps = self._steps, []
        tensors = [v for _, values in steps for v in values.values() if isinstance(v, torch.Tensor)]
        numbers = iter(torch.stack([t.detach().double().reshape(()) for t in tensors]).tolist() if tensors else [])
        rows = []
        for step, values in steps:
            row: dict[str, object] = {"step": step}
            for name, value in values.items():
                if isinstance(value, torch.Tensor):
                    number = next(numbers)
                    value = bool(number) if value.dtype == torch.bool else number
                row[name] = value
            rows.append(row)
        return rows
