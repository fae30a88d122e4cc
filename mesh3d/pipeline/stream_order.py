"""Stream order made explicit where a stage's shards are written on one CUDA stream and read on another.

A weight-version swap or an in-pipeline update (weight_versions.py) writes a stage's local shards
on the current stream; FSDP2 reads them on its own all-gather streams (the copy-in stream, then
the all-gather stream), which it makes wait for the current stream only in a root's
pre-forward. A backward after a swap, whose FSDP pre-backward gathers again, could then gather
the old or a half-written version, and a gather still in flight could read the shards while they
change. `shard_writes` orders both sides: before the write the current stream waits for FSDP's
gather streams, after it they wait for the current stream. On CPU (gloo) there is one host
thread and no stream to order: it does nothing.

The pipeline's other hand-overs are ordered by torch and the mailbox (p2p.py): ProcessGroupNCCL
makes its stream wait for the current stream when a send is queued, and the mailbox keeps the
sent tensor until the send completes; a receive lands on NCCL's stream and `Mailbox.take` waits
on its work (the current stream then waits for NCCL's) before its consumer reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn


def _comm_contexts(units: Iterable[nn.Module]) -> list:
    """The FSDP2 communication contexts (one per FSDP root) serving `units`, each once; none for
    units on CPU or before FSDP's lazy init created the streams (the first forward orders itself)."""
    contexts = {}
    for unit in units:
        state = unit._get_fsdp_state()
        context = state._comm_ctx
        if state._device.type != "cpu" and hasattr(context, "all_gather_stream"):
            contexts[id(context)] = context
    return list(contexts.values())


def gather_streams(units: Iterable[nn.Module]) -> list[torch.Stream]:
    """FSDP2's all-gather streams (copy-in and all-gather) that gather the shards of `units` (FSDP
    modules), each once; empty on CPU and before the first forward."""
    return [s for c in _comm_contexts(units) for s in (c.all_gather_copy_in_stream, c.all_gather_stream)]


@contextlib.contextmanager
def shard_writes(units: Iterable[nn.Module]) -> Iterator[None]:
    """Inside: writes to the local shards of `units` (FSDP modules, resharded) on the current
    stream. Before them the current stream waits for FSDP's gathers already queued (which may
    still read the old values); after them FSDP's gather streams wait for the writes."""
    contexts = _comm_contexts(units)
    for context in contexts:
        current = context.device_handle.current_stream()
        current.wait_stream(context.all_gather_copy_in_stream)
        current.wait_stream(context.all_gather_stream)
    yield
    for context in contexts:
        current = context.device_handle.current_stream()
        context.all_gather_copy_in_stream.wait_stream(current)
        context.all_gather_stream.wait_stream(current)
