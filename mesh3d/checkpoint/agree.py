"""Errors that one rank meets (a full disk, a bad file) raised on every rank, so none waits alone in a collective."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from mesh3d.mesh import Layout


def attempt(fn: Callable[[], object]) -> str | None:
    """Run fn on this rank; its exception as text (for `agree`), or None."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - every rank must learn of it, not only this one
        return f"{type(error).__name__}: {error}"
    return None


def agree(layout: Layout, error: str | None) -> None:
    """Raise the first failing rank's error on every rank (one small all-gather; a barrier too)."""
    errors = [error]
    if layout.world_size > 1:
        errors = [None] * layout.world_size
        dist.all_gather_object(errors, error)
    for rank, message in enumerate(errors):
        if message:
            raise ValueError(message if rank == layout.rank else f"{message} (found on rank {rank})")
