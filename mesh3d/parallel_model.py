"""ParallelModel: this rank's part of a parallelized model, and the calls a training loop makes on it."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from mesh3d.data.parallel import GradientSync
from mesh3d.mesh import Layout
from mesh3d.pipeline.runtime import PipelineRuntime
from mesh3d.pipeline.schedules import Schedule
from mesh3d.pipeline.tied import TiedWeights, local_tensor


class ParallelModel:
    """What `mesh3d.parallelize` returns: the stages this rank owns, wired into a pipeline schedule.

    Parameter names are always those of the unsplit model. Build an optimizer over
    `pm.parameters()`; call `pm.step(inputs, targets)` for a whole pipelined forward and backward.
    Under tensor or data parallelism the parameters are DTensors (this rank's shards); each
    data-parallel rank passes its own share of the global batch, every tp rank of one replica the
    same share.
    """

    def __init__(
        self,
        layout: Layout,
        stages: dict[int, nn.Module],
        stage_layers: list[range],
        schedule: Schedule,
        runtime: PipelineRuntime,
        tied: TiedWeights,
        state_owner: dict[str, int],
        state_specs: dict[str, tuple[torch.Size, torch.dtype]],
        *,
        grad_sync: GradientSync | None = None,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
    ):
        self.layout = layout
        self.stages = stages
        self.stage_layers = stage_layers
        self.schedule = schedule
        self.runtime = runtime
        self.tied = tied
        self._state_owner = state_owner  # every state_dict key of the unsplit model -> stage holding it
        self._state_specs = state_specs
        self.grad_sync = grad_sync  # None when dp == 1
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel

    # -- running ------------------------------------------------------------------------------

    def _check_batch(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> None:
        m = self.schedule.microbatches
        if inputs.dim() == 0 or inputs.shape[0] % m != 0:
            raise ValueError(
                f"a batch of {inputs.shape[0] if inputs.dim() else 0} samples does not split into "
                f"microbatches={m} equal microbatches (dim 0); use a batch size that is a multiple of {m}"
            )
        if targets is not None and targets.shape[0] != inputs.shape[0]:
            raise ValueError(f"inputs have {inputs.shape[0]} samples but targets have {targets.shape[0]}")
        tp = self.layout.tp
        if self.sequence_parallel and (inputs.dim() < 2 or inputs.shape[1] % tp != 0):
            raise ValueError(
                f"sequence length {inputs.shape[1] if inputs.dim() >= 2 else None} is not divisible by tp={tp}; the tp "
                f"plan uses sequence parallel, which splits dim 1 over the tp ranks: use a multiple of {tp}"
            )

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every microbatch; gradients accumulate into `.grad`.

        Gradients equal those of one process computing loss_fn(model(inputs), targets).backward()
        on the global batch (the dp ranks' shares together): data-parallel gradients are reduced
        once, on each stage's last backward. Returns the global mean loss, a 0-dim tensor with
        the same value on every rank.
        """
        self._check_batch(inputs, targets)
        self.runtime.check(inputs, targets)  # fail before tied gradients are set aside
        self._check_output_layout()
        self.tied.set_aside_grads()
        try:
            local_sum = self.runtime.run(inputs, targets, train=True)
        except BaseException:
            # The step is lost. Drop what data parallelism holds unreduced (zero_grad cannot reach
            # it) and give tied copies back their earlier gradients; .grad may still hold parts of
            # the failed step, so call zero_grad() before the next one.
            self.tied.restore_set_aside()
            if self.grad_sync is not None:
                self.grad_sync.abort()
            raise
        self._settle_tensor_parallel_grads()
        self.tied.sync_grads()
        return self._mean_loss(local_sum)

    @torch.no_grad()
    def _settle_tensor_parallel_grads(self) -> None:
        """Give every DTensor gradient its parameter's placements.

        Autograd leaves some tensor-parallel gradients pending or laid out differently from the
        parameter: a norm weight under sequence parallel gets Partial(sum) (one part per sequence
        shard), a vocab-sharded embedding a Replicate gradient. Redistributing sums the parts over
        tp and keeps each rank's own slice, so the optimizer, the tie all-reduce and the norm all
        see shards aligned with the parameters. (FSDP already does this in its reduce-scatter.)
        """
        for param in self.parameters():
            grad = param.grad
            if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
                param.grad = grad.redistribute(param.device_mesh, param.placements)

    def _check_output_layout(self) -> None:
        placements, ndim = self.runtime.output_placements, self.runtime.output_ndim
        last_dim_sharded = any(p.is_shard() and p.dim % ndim == ndim - 1 for p in placements or ())
        if self.loss_parallel and not last_dim_sharded:
            raise ValueError(
                f"loss_parallel=True needs the model output to stay a vocab-sharded DTensor (Shard(-1)), but the tp plan "
                f"gives {placements or 'a plain tensor'}; shard the output head with "
                "ColwiseParallel(output_layouts=Shard(-1), use_local_output=False), e.g. llama_tp_plan(loss_parallel=True)"
            )

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of a forward pass only (no gradients, modules in eval mode), the same on every rank."""
        self._check_batch(inputs, targets)
        self.runtime.check(inputs, targets)
        self._check_output_layout()
        modes = {m: m.training for stage in self.stages.values() for m in stage.modules()}
        self.eval()
        try:
            return self._mean_loss(self.runtime.run(inputs, targets, train=False))
        finally:
            for module, training in modes.items():
                module.training = training
            if self.grad_sync is not None:
                self.grad_sync.end_forward_only()  # no backward came to reshard what the forwards gathered

    def train(self, mode: bool = True) -> ParallelModel:
        """Set train/eval mode on every local stage (dropout and the like), as nn.Module.train does."""
        for stage in self.stages.values():
            stage.train(mode)
        return self

    def eval(self) -> ParallelModel:
        return self.train(False)

    def _mean_loss(self, local_sum: torch.Tensor) -> torch.Tensor:
        # Only last-stage ranks add to the sum; each of their tp ranks holds the same value.
        total = local_sum.detach().float().clone()
        if self.layout.world_size > 1:
            dist.all_reduce(total)
        return total / (self.schedule.microbatches * self.layout.dp * self.layout.tp)

    @property
    def peak_live_activations(self) -> int:
        """Most stage-microbatch forwards this rank held for their backward during the last step."""
        return self.runtime.counters.peak_live_activations

    # -- parameters ---------------------------------------------------------------------------

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the unsplit model's names (a shared tensor once)."""
        seen: set[int] = set()
        for index in sorted(self.stages):
            for name, param in self.stages[index].named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters; pass them to the optimizer."""
        for _, param in self.named_parameters():
            yield param

    def zero_grad(self, set_to_none: bool = True) -> None:
        for stage in self.stages.values():
            stage.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so the whole model's gradient norm is at most `max_norm`.

        The norm is over every parameter of the unsplit model, each counted once (a tied weight
        too, and a weight replicated over tp or dp ranks), over all of pp, dp and tp, and is the
        same on every rank. Returns the norm before clipping.
        """
        norm_type = float(norm_type)
        with_grad = [p for p in self.parameters() if p.grad is not None]
        grads = [local_tensor(p.grad) for p in with_grad]
        counted = [(local_tensor(p.grad), self._replicas(p.grad)) for p in with_grad if not self.tied.is_secondary_copy(p)]
        device = self.layout.device
        if math.isinf(norm_type):
            local = max((g.abs().max().float() for g, _ in counted if g.numel()), default=torch.zeros((), device=device))
            op = dist.ReduceOp.MAX
        else:
            # A value held by r ranks enters the world-wide sum r times: each adds 1/r of it.
            local = sum((g.float().norm(norm_type) ** norm_type / r for g, r in counted), torch.zeros((), device=device))
            op = dist.ReduceOp.SUM
        total = local.clone()
        if self.layout.world_size > 1:
            dist.all_reduce(total, op=op)
        if not math.isinf(norm_type):
            total = total ** (1.0 / norm_type)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return total

    def _replicas(self, tensor: torch.Tensor) -> int:
        """How many ranks at this pp rank hold the same values as this rank's part of `tensor`:
        the sizes of the dp and tp axes it is not sharded over."""
        sharded = set()
        if isinstance(tensor, DTensor):
            names = tensor.device_mesh.mesh_dim_names or ()
            sharded = {name for name, placement in zip(names, tensor.placements) if not placement.is_replicate()}
        return math.prod(getattr(self.layout, dim) for dim in ("dp", "tp") if dim not in sharded)

    # -- whole-model state ----------------------------------------------------------------------

    @property
    def state_specs(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Global shape and dtype of every state_dict entry of the unsplit model, in its order
        (both names of a tied weight); the same on every rank."""
        return {name: self._state_specs[name] for name in self._state_owner}

    def state_owner_pp_rank(self, name: str) -> int:
        """The pp rank whose stages hold state_dict entry `name` (for a tied weight, its first stage's)."""
        return self.schedule.stage_rank(self._state_owner[name])

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state_dict entries under the unsplit model's names, as held (DTensor shards
        under tp/dp, sharing storage with the parameters); a name held by two local stages once."""
        return self._local_state()

    def _local_state(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for index in sorted(self.stages):
            for name, tensor in self.stages[index].state_dict(keep_vars=True).items():
                state.setdefault(name, tensor)
        return state

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit model's state_dict (both names of a tied weight), full tensors on CPU, on every rank."""
        local = self._local_state()
        group = self.layout.group("pp") if self.layout.pp > 1 else None
        ranks = self.layout.group_ranks("pp")
        full = {}
        for name, stage in self._state_owner.items():
            owner = self.schedule.stage_rank(stage)
            if owner == self.layout.pp_rank:
                tensor = local[name].detach()
                tensor = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).contiguous()
            else:
                shape, dtype = self._state_specs[name]
                tensor = torch.empty(shape, dtype=dtype, device=self.layout.device)
            if group is not None:
                dist.broadcast(tensor, src=ranks[owner], group=group)
            full[name] = tensor.cpu().clone()
        return full

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the unsplit model's state_dict (every rank passes all of it; each keeps its part)."""
        missing = [k for k in self._state_owner if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._state_owner]
        if missing or unexpected:
            raise ValueError(
                f"load_full_state_dict: the state_dict does not fit the model: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
            )
        for name, (shape, _) in self._state_specs.items():
            if tuple(state_dict[name].shape) != tuple(shape):
                raise ValueError(
                    f"load_full_state_dict: {name} has shape {tuple(state_dict[name].shape)}, the model expects {tuple(shape)}"
                )
        for tie in self.tied.ties:  # one weight in the model: its names must agree
            for name in tie.names[1:]:
                if not torch.equal(state_dict[name], state_dict[tie.names[0]]):
                    raise ValueError(
                        f"load_full_state_dict: {name} and {tie.names[0]} are one tied weight in the model, but the "
                        "state_dict gives them different values; pass the same tensor for both"
                    )
        for name, tensor in self._local_state().items():
            value = state_dict[name].to(device=tensor.device, dtype=tensor.dtype)
            if isinstance(tensor, DTensor):  # every rank has the full value: each keeps its own shard
                value = distribute_tensor(value, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            local_tensor(tensor.detach()).copy_(value)
        self.tied.sync_values()

    def __repr__(self) -> str:
        s = self.schedule
        mine = {i: f"layers {r.start}..{r.stop - 1}" for i, r in enumerate(self.stage_layers) if i in self.stages}
        return (
            f"ParallelModel({self.layout!r}, schedule={s.name}, microbatches={s.microbatches}, "
            f"virtual_stages={s.virtual_stages}, stages here={mine})"
        )
