"""parallelize's `float8=`: the blocks' linear layers computed in float8 through torchao.

torchao's Float8Linear is an nn.Linear whose matmuls cast input, weight and output gradient to
float8 with dynamic scales (`torch._scaled_mm`); parameters, names and what the optimizer sees stay
as they were. Which linears are converted is decided here on the whole (meta) model, before any
collective, so every rank converts the same ones and refuses the same combinations; the stages are
converted after the split and before tensor parallelism, compile and FSDP (torchao's order).

torchao is an optional dependency (`pip install "mesh3d[float8]"`): imported only when asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from mesh3d.model.anatomy import Anatomy

RECIPES = ("tensorwise", "rowwise")  # torchao's recipe names: one scale per tensor, or per row
INSTALL = 'pip install "mesh3d[float8]"'
MULTIPLE = 16  # torch._scaled_mm wants both dims of each operand divisible by 16
# A mixture of experts' router (Mixtral's and Qwen3-MoE's `gate`) picks experts by comparing its
# outputs: float8 rounding would flip choices, and it is a small matmul anyway (torchtitan skips it too)
ROUTERS = ("gate", "router")


@dataclass(frozen=True)
class Float8Config:
    """What `float8=` converts, after the argument checks (see `resolve`)."""

    recipe: str | None = None  # None: off
    modules: tuple[str, ...] = ()  # the converted linears, by their names in the unsplit model
    all_gather: bool = False  # FSDP gathers the weights in float8 (tensorwise under fsdp/hsdp)
    precompute: bool = False  # one amax all-reduce for every weight before each step (see precompute_scales)
    tp_plan: dict[str, ParallelStyle] = field(default_factory=dict)  # the tp plan, float8 styles swapped in

    @classmethod
    def resolve(
        cls,
        float8: str | None,
        model: nn.Module,
        anatomy: Anatomy,
        tp_plan: dict[str, ParallelStyle],
        *,
        tp: int,
        ep: int,
        shards_weights: bool,
        never_drains: bool,
        traced: bool,
    ) -> Float8Config:
        """Check `float8=` against the other arguments, on the meta model: pure, alike on every rank.

        `tp_plan`: the resolved plan ({module name: style}, empty at tp = 1); `shards_weights`: the
        stages are wrapped by FSDP/HSDP (not DDP, not unwrapped).
        """
        if float8 is None:
            return cls(tp_plan=tp_plan)
        if float8 not in RECIPES:
            raise ValueError(f"float8={float8!r}; choose one of {[None, *RECIPES]} (torchao's recipe names)")
        torchao_float8()  # refuse early, on every rank, when torchao is missing
        if traced:
            raise ValueError(
                f"float8={float8!r} converts the linear layers of the blocks, and a traced model (example_inputs=) "
                "has its layers inside a graph; use float8=None, or bring the model as the mesh3d protocol"
            )
        if ep > 1:
            raise ValueError(
                f"float8={float8!r} with ep={ep} is not built (torchao's float8 experts need a grouped matmul); "
                "use ep=1 or float8=None"
            )
        if float8 == "rowwise" and tp > 1:
            raise ValueError(
                f"float8='rowwise' with tp={tp}: torchao's float8 tensor-parallel styles assume one scale per "
                "tensor; use float8='tensorwise' with tp > 1, or tp=1 with 'rowwise'"
            )
        modules = tuple(convertible(model, anatomy, tp_plan if tp > 1 else None, tp))
        if not modules:
            raise ValueError(
                f"float8={float8!r}: no linear layer of {type(model).__name__}'s blocks can be converted (each needs "
                f"in and out features divisible by {MULTIPLE}"
                + (", and a plain Colwise/RowwiseParallel style" if tp > 1 else "")
                + "); use float8=None"
            )
        all_gather = float8 == "tensorwise" and shards_weights
        return cls(
            float8,
            modules,
            all_gather,
            precompute=all_gather and not never_drains,  # never-drain updates mid-step: a scale would go stale
            tp_plan=float8_tp_plan(tp_plan, set(modules)) if tp > 1 else tp_plan,
        )

    def __str__(self) -> str:
        return f"float8={self.recipe} all_gather={self.all_gather} converted={len(self.modules)}"

    def convert(self, stages: Iterable[nn.Module]) -> None:
        """Swap the chosen linears of each stage (stages keep the unsplit model's names) for torchao's
        Float8Linear, in place; meta stages too (the weights stay on meta until allocated)."""
        if self.recipe is None:
            return
        float8 = torchao_float8()
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        if self.all_gather:  # the recipe's config with FSDP's float8 all-gather turned on
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        chosen = set(self.modules)
        for stage in stages:
            float8.convert_to_float8_training(stage, config=config, module_filter_fn=lambda _, name: name in chosen)


def torchao_float8():
    """torchao.float8, or an ImportError saying how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError as missing:
        raise ImportError(f"float8= trains through torchao, which is not installed: {INSTALL}") from missing
    return float8


def convertible(
    model: nn.Module, anatomy: Anatomy, tp_plan: dict[str, ParallelStyle] | None = None, tp: int = 1
) -> list[str]:
    """The names of the linears float8 converts: inside the repeated blocks (the embedding and the
    head stay in high precision: they are the layers most sensitive to rounding, as in torchtitan),
    with in and out features (of each rank's shard) divisible by 16, and, under tp (`tp_plan`
    given), sharded by a plain Colwise or RowwiseParallel, the styles torchao has float8 twins of
    (a custom style keeps its linear as it is)."""
    prefixes = [anatomy.block_path(key) + "." for key in anatomy.block_names(model)]
    ends = [path + "." for path in (*anatomy.first, *anatomy.last)]  # nn.Sequential: its ends are children too
    names = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or not any(name.startswith(p) for p in prefixes):
            continue  # an exact nn.Linear: a subclass (already float8, or quantized) is someone else's
        if any((name + ".").startswith(end) for end in ends):
            continue
        if name.rsplit(".", 1)[-1] in ROUTERS:
            continue
        style = (tp_plan or {}).get(name)
        if tp_plan is not None and type(style) not in (ColwiseParallel, RowwiseParallel):
            continue
        # each rank multiplies its shard: the dim the style splits must stay a multiple of 16 after the split
        rows = module.out_features // (tp if isinstance(style, ColwiseParallel) else 1)
        cols = module.in_features // (tp if isinstance(style, RowwiseParallel) else 1)
        if rows % MULTIPLE or cols % MULTIPLE:
            continue
        names.append(name)
    return names


def float8_tp_plan(plan: dict[str, ParallelStyle], converted: set[str]) -> dict[str, ParallelStyle]:
    """The resolved plan with each converted linear's style swapped for torchao's float8 twin, the
    same layouts kept: the twin casts what crosses the tp ranks (its input, its output's gradient)
    to float8 before it travels. Module inputs (PrepareModuleInput) keep the plain style: they may
    feed more than the converted linears."""
    if not converted:
        return plan
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    swapped = dict(plan)
    for name in converted:
        style = plan[name]
        twin = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
        swapped[name] = twin(
            input_layouts=style.input_layouts[0],
            output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )
    return swapped


def precompute_scales(stages: Iterable[nn.Module]) -> None:
    """Before a step: every float8 weight's scale from one amax all-reduce per stage, instead of one
    per weight inside FSDP's all-gathers. Run after every weight change (an optimizer step, a load):
    pm.step calls it first thing, so an optimizer mesh3d does not own is covered too."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for stage in stages:
        precompute_float8_dynamic_scale_for_fsdp(stage)
