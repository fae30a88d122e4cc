"""A model's anatomy: where its repeated blocks are, what only the first or the last stage keeps,
and how a stage cut from it runs.

Each way a model comes in (model/intake.py) becomes an Anatomy, so that the split, tensor and
data parallelism, compile and the checkpoints see one shape. A stage is a copy of the whole model
with what it does not own removed (model/cut.py), or, traced, a graph over copies of the model's
modules it calls: every parameter keeps its name in the unsplit model either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from mesh3d.expert_parallel.plan import ExpertPlan
from mesh3d.model.router_aux import RouterAux

if TYPE_CHECKING:
    from mesh3d.model.traced.capture import TracedModel

# (stage copy, is first stage, is last stage, the block indices it keeps) -> the runnable stage
StageMaker = Callable[[nn.Module, bool, bool, range], nn.Module]


@dataclass(frozen=True)
class Anatomy:
    """How to cut one model into pipeline stages."""

    name: str  # for messages: the model's class and which way it came in
    layers: str  # dotted path of the container of the repeated blocks ("" is the model itself)
    first: tuple[str, ...] = ()  # dotted paths of modules only the first stage keeps
    last: tuple[str, ...] = ()  # dotted paths of modules only the last stage keeps
    # among `first` and `last`: where dropped, an nn.Identity stands in (the forward calls it regardless)
    identity_when_dropped: tuple[str, ...] = ()
    make_stage: StageMaker | None = None  # None: the cut copy runs its own forward
    tp_plan: dict | None = None  # the plan from the model's own declaration, when it has one
    tp_plan_refusal: str | None = None  # why the model's own declaration gives no plan (raised when tp > 1)
    tensor_parallel_sizes: dict[str, int] = field(default_factory=dict)  # sizes tp must divide, by name
    vocab_size: int | None = None  # the declared vocabulary (ids the data may hold), when known
    # per-sample inputs that index something: {name: n}, each an integer tensor in [0, n) (model/stage_inputs.py)
    input_index_bounds: dict[str, int] = field(default_factory=dict)
    # (stage from meta, seed) -> fresh values, the same for a module whichever stage holds it; None: the
    # model's own init_weights() (model/initialize.py)
    init_stage: Callable[[nn.Module, int], None] | None = None
    fake_shape_run: bool = False  # its forward reads values: a shape run that fails on meta runs on fake
    traced: TracedModel | None = None  # a traced model: stages come from its capture, not from a cut
    # Context parallelism: the per-sample input through which each stage is handed its mask over its own
    # tokens (a 4-d bool, the model's own mask code left out; documents read from restarting position
    # ids), or None: the model builds its mask itself (context_parallel/sdpa_calls.py)
    cp_mask_input: str | None = None
    cp_refusal: str | None = None  # why the model cannot run under cp > 1 (raised then, by name)
    # A mixture of experts' router load-balancing loss: every stage but the last returns (activation,
    # routing sums), every stage but the first takes them, the last returns (output, sums) (router_aux.py)
    router_aux: RouterAux | None = None
    # Expert parallelism: which modules hold experts (expert_parallel/plan.py), or why the model's experts
    # cannot be split (raised when ep > 1)
    expert_plan: ExpertPlan | None = None
    expert_plan_refusal: str = "ep > 1 splits the experts of a Hugging Face mixture of experts; this model has none"

    def container(self, module: nn.Module) -> nn.Module:
        """The blocks' container in `module` (the whole model or a stage cut from it)."""
        return module.get_submodule(self.layers) if self.layers else module

    def block_names(self, module: nn.Module) -> list[str]:
        """The keys of the blocks `module` holds, in order ("0".."L-1" for the whole model)."""
        return [key for key, block in self.container(module)._modules.items() if block is not None]

    def blocks(self, module: nn.Module) -> list[nn.Module]:
        """The blocks `module` holds, in order."""
        container = self.container(module)
        return [container._modules[key] for key in self.block_names(module)]

    def block_path(self, key: str) -> str:
        """The dotted name of block `key` in the unsplit model."""
        return f"{self.layers}.{key}" if self.layers else key

    def end_modules(self, model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
        """The modules of the first stage's end and of the last stage's end."""
        return [model.get_submodule(p) for p in self.first], [model.get_submodule(p) for p in self.last]
