"""The state map: the whole model's state as names of the unsplit model, wherever it lives.

Every state_dict entry of the unsplit model (parameters and persistent buffers, both names of a
tied weight) has one owner: the pp rank of the first stage that holds it. The map knows each
name's global shape and dtype (the same on every rank, from the meta stages), this rank's part of
it, and how to move whole tensors: gathered to every rank or to one rank, and loaded back with
each rank taking only its own slice. ParallelModel's whole-model calls, the distributed
checkpoint and the safetensors exporter and importer all go through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mesh3d.distributed.shards import local_blocks, local_tensor
from mesh3d.mesh import Layout

Spec = tuple[torch.Size, torch.dtype]


class StateMap:
    """Which pp rank owns each state name of the unsplit model, its spec, and whole-tensor moves.

    Args:
        layout: this rank's Layout.
        owners: every state name of the unsplit model, in its state_dict order -> owning pp rank.
        specs: every state name -> (global shape, dtype).
        ties: groups of names that are one tensor in the unsplit model (a tied weight).
        stages: this rank's stage modules (looked at when asked, so what tensor or data
            parallelism replaced is seen as it is now).
    """

    def __init__(
        self,
        layout: Layout,
        owners: dict[str, int],
        specs: dict[str, Spec],
        ties: list[list[str]],
        stages: dict[int, nn.Module],
    ):
        self.layout = layout
        self._owners = owners
        self._specs = specs
        self.ties = ties
        self._stages = stages

    @classmethod
    def from_stages(
        cls,
        layout: Layout,
        meta_model: nn.Module,
        meta_stages: list[nn.Module],
        stage_rank: Callable[[int], int],
        ties: list[list[str]],
        stages: dict[int, nn.Module],
    ) -> StateMap:
        """The map of a model split into `meta_stages` (every stage, on meta), stage s on pp rank stage_rank(s)."""
        owner_stage: dict[str, int] = {}
        specs: dict[str, Spec] = {}
        for index, stage in enumerate(meta_stages):
            for name, tensor in stage.state_dict(keep_vars=True).items():
                if name not in owner_stage:
                    owner_stage[name], specs[name] = index, (tensor.shape, tensor.dtype)
        ordered = [name for name in meta_model.state_dict(keep_vars=True) if name in owner_stage]
        return cls(layout, {name: stage_rank(owner_stage[name]) for name in ordered}, specs, ties, stages)

    @property
    def specs(self) -> dict[str, Spec]:
        """Global shape and dtype of every state name, in the unsplit model's order; the same on every rank."""
        return {name: self._specs[name] for name in self._owners}

    def owner_pp_rank(self, name: str) -> int:
        """The pp rank whose stages hold `name` (for a tied weight, its first stage's)."""
        return self._owners[name]

    def stored_names(self) -> dict[str, str]:
        """Every state name -> the one name its tensor goes by (a tied weight's first name)."""
        canonical = {name: names[0] for names in self.ties for name in names}
        return {name: canonical.get(name, name) for name in self._owners}

    def local(self) -> dict[str, torch.Tensor]:
        """This rank's entries, as held (DTensor shards under tp/dp, sharing storage with the
        parameters); a name held by two local stages once."""
        state: dict[str, torch.Tensor] = {}
        for index in sorted(self._stages):
            for name, tensor in self._stages[index].state_dict(keep_vars=True).items():
                state.setdefault(name, tensor)
        return state

    @torch.no_grad()
    def gather(self, names: Iterable[str], to: int | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(name, full tensor on CPU) for each name, one tensor at a time. Call on every rank with the same names.

        to=None: every rank gets every tensor (assembled on its owning pp rank, then broadcast along pp).
        to=r: only global rank r gets them (None elsewhere); from the owning pp rank, the rank at
        r's dp and tp coordinates sends it.
        """
        layout = self.layout
        local = self.local()
        pp_group = layout.group("pp") if layout.pp > 1 else None
        pp_ranks = layout.group_ranks("pp")
        for name in names:
            owner = self._owners[name]
            full = None
            if layout.pp_rank == owner:  # the owner's dp and tp ranks assemble it together
                tensor = local[name].detach()
                full = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).contiguous()
            if to is None:
                if full is None:
                    shape, dtype = self._specs[name]
                    full = torch.empty(shape, dtype=dtype, device=layout.device)
                if pp_group is not None:
                    dist.broadcast(full, src=pp_ranks[owner], group=pp_group)
                yield name, full.cpu().clone()
                continue
            source = layout.rank_at(owner, *layout.coordinate_of(to)[1:])
            if layout.rank == to and source != to:
                shape, dtype = self._specs[name]
                full = torch.empty(shape, dtype=dtype, device=layout.device)
                dist.recv(full, src=source)
            elif layout.rank == source != to:
                dist.isend(full, dst=to).wait()
                if full.is_cuda:  # NCCL's send is only queued: wait until it is done, so no owner races ahead
                    torch.cuda.current_stream(full.device).synchronize()  # holding tensors the writer has not taken
            yield name, full.cpu() if layout.rank == to else None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit model's state_dict (both names of a tied weight), full tensors on CPU, on every rank."""
        return dict(self.gather(self._owners))

    @torch.no_grad()
    def load_by_slice(self, read: Callable[[str, tuple[slice, ...]], torch.Tensor]) -> None:
        """Fill this rank's entries: read(name, window) returns the slice `window` of the full tensor `name`.

        Each rank asks only for what it holds; nothing is sent. Tied copies on other ranks are the
        caller's to make equal afterwards (they read the same values when read is deterministic).
        """
        for name, tensor in self.local().items():
            local = local_tensor(tensor.detach())
            for window, local_window in local_blocks(tensor):  # none for an empty shard, several for a strided one
                values = read(name, window)
                local[local_window].copy_(values.to(device=tensor.device, dtype=tensor.dtype))

    def check_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Raise ValueError unless `state_dict` holds exactly the model's names, shapes, and equal tied values."""
        missing = [k for k in self._owners if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._owners]
        if missing or unexpected:
            raise ValueError(
                f"load_full_state_dict: the state_dict does not fit the model: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
            )
        for name, (shape, _) in self.specs.items():
            if tuple(state_dict[name].shape) != tuple(shape):
                raise ValueError(
                    f"load_full_state_dict: {name} has shape {tuple(state_dict[name].shape)}, "
                    f"the model expects {tuple(shape)}"
                )
        for names in self.ties:  # one weight in the model: its names must agree
            for name in names[1:]:
                if not torch.equal(state_dict[name], state_dict[names[0]]):
                    raise ValueError(
                        f"load_full_state_dict: {name} and {names[0]} are one tied weight in the model, but the "
                        "state_dict gives them different values; pass the same tensor for both"
                    )
