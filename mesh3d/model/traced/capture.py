"""Capturing a model with torch.export and splitting it with torch's pipeline frontend.

`torch.distributed.pipelining.pipeline(model, example_inputs, split_spec={block: BEGINNING})`
exports the model (on meta: no values are touched) and cuts the graph where the named blocks
begin. Its top-level graph spells out what flows between the stages: a stage returning a tuple,
`getitem` picking what each later stage takes, and a stage reading an output of a stage before
its predecessor (a skip connection) straight from it. That becomes the routes the runtime follows
(pipeline/routes.py): which outputs each consumer takes, and the skips.

Each stage's own graph calls the model's modules by their names in the model (`emb`,
`blocks.3`); torch hands them back as re-traced InterpreterModules (no nn.Linear for tensor
parallelism's styles, no reset_parameters, ties as copies). mesh3d instead builds the stage as an
fx.GraphModule over the same graph rooted at the model itself, which takes the model's own
modules (and any parameter the graph reads directly) at those names: a stage keeps the unsplit
model's parameter names, real module classes and ties within it, and runs each module's own
forward. A stage is a copy, as a cut stage is (model/cut.py), so the model given stays untouched.

A model may take per-sample inputs besides the tokens (a mask, position ids): the example inputs
name them, `(tokens, {"mask": mask})`, and the forward takes them by those keywords. They are
captured as inputs of the graph; each stage that reads one takes it as a keyword parameter of
that name (its `per_sample_inputs`), handed by the runtime from the step's batch, never routed
between stages (model/stage_inputs.py).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from mesh3d.model.meta_copy import meta_copy
from mesh3d.model.traced.keyword_inputs import check_keyword_reads, keyword_placeholders, keywords_last

ADVICE = (
    "bring the model through the mesh3d protocol instead (repeated blocks in an nn.ModuleDict `layers`, one "
    "forward that tolerates missing parts; docs/model_protocol.md)"
)


@dataclass(frozen=True)
class TracedSplit:
    """A captured model cut into stages: each stage's graph and what flows between them."""

    graphs: tuple[fx.Graph, ...]  # per stage; placeholders in the runtime's input order
    skips: tuple[tuple[int, int], ...]  # (producer, consumer) past the next stage
    takes: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)  # producer outputs per consumer
    per_sample: tuple[tuple[str, ...], ...] = ()  # per stage: the per-sample inputs it reads, by keyword

    def stage(self, model: nn.Module, index: int) -> nn.Module:
        """Stage `index` as a copy of the model's modules it calls, at their names in the model."""
        graph = copy.deepcopy(self.graphs[index])
        stage = copy.deepcopy(fx.GraphModule(model, graph, class_name=f"TracedStage{index}"))
        stage.per_sample_inputs = self.per_sample[index] if self.per_sample else ()
        return stage


class TracedModel:
    """A model torch.export captures from `example_inputs` (one microbatch: the tokens, then
    optionally {name: tensor} of the per-sample inputs its forward takes by keyword), split by
    block names."""

    def __init__(self, model: nn.Module, example_inputs: tuple, name: str):
        if not _well_formed(example_inputs):
            raise ValueError(
                f"{name}: example_inputs must be (tokens,) or (tokens, {{name: tensor}}): one microbatch of what "
                "pm.step takes as inputs (the first stage receives the tokens), then the per-sample inputs the "
                f"forward takes by keyword, as pm.step(inputs, targets, **per_sample) will; got "
                f"{_describe(example_inputs)}"
            )
        self.name = name
        self.meta_model = _meta_copy(model)
        self.inputs = (torch.empty_like(example_inputs[0], device="meta"),)
        named = example_inputs[1] if len(example_inputs) == 2 else {}
        self.per_sample = {k: torch.empty_like(t, device="meta") for k, t in named.items()}
        self._splits: dict[tuple[str, ...], TracedSplit] = {}

    def check_capturable(self) -> None:
        """Capture the whole model once (no split): torch's reason, as a ValueError, if it cannot."""
        self._pipe(())

    def split(self, starts: Sequence[str]) -> TracedSplit:
        """The stages beginning at the blocks named `starts` (the first stage begins at the model's start)."""
        key = tuple(starts)
        if key not in self._splits:
            self._splits[key] = self._split(key)
        return self._splits[key]

    def _pipe(self, starts: tuple[str, ...]):
        from torch.distributed.pipelining import SplitPoint, pipeline

        try:
            return pipeline(
                self.meta_model,
                self.inputs,
                mb_kwargs=self.per_sample or None,
                split_spec={s: SplitPoint.BEGINNING for s in starts},
            )
        except Exception as error:  # torch's own reason: its message points at the cause
            cause = error.__cause__ if error.__cause__ is not None else error
            reason = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
            raise ValueError(
                f"{self.name}: torch.export cannot capture this model as one graph, so mesh3d cannot split it by "
                f"tracing ({reason}); {ADVICE}"
            ) from error
        finally:
            _unannotate(self.meta_model, starts)

    def _split(self, starts: tuple[str, ...]) -> TracedSplit:
        pipe = self._pipe(starts)
        top = pipe.split_gm.graph
        stage_nodes = [n for n in top.nodes if n.op == "call_module" and str(n.target).startswith("submod_")]
        if len(stage_nodes) != len(starts) + 1:
            raise ValueError(
                f"{self.name}: split at {list(starts)} gave {len(stage_nodes)} stages, not {len(starts) + 1}; every "
                "split point must be a block the model's forward calls, in order"
            )
        stage_of = {node: index for index, node in enumerate(stage_nodes)}
        outputs = [a for a in fx.node.map_arg(next(n for n in top.nodes if n.op == "output").args, lambda a: a)[0]]
        if len(outputs) != 1 or outputs[0] is not stage_nodes[-1]:
            raise ValueError(
                f"{self.name}: the model must return one tensor, computed by its last stage (the loss takes it); "
                f"its output is {len(outputs)} values"
            )
        # Per stage, which of its arguments are per-sample inputs (graph inputs other than the tokens), by name.
        named = [
            {i: a.target for i, a in enumerate(node.args) if _is_input(a) and a.target in self.per_sample}
            for node in stage_nodes
        ]
        sources = [[]] + [
            [self._source(a, stage_of, s) for i, a in enumerate(node.args) if i not in named[s]]
            for s, node in enumerate(stage_nodes)
            if s
        ]
        takes: dict[tuple[int, int], tuple[int, ...]] = {}
        for s, stage_sources in enumerate(sources[1:], start=1):
            if stage_nodes[s].kwargs:
                raise ValueError(f"{self.name}: stage {s} takes keyword inputs {list(stage_nodes[s].kwargs)}")
            for p, k in stage_sources:
                takes.setdefault((p, s), ())
                if k not in takes[(p, s)]:
                    takes[(p, s)] += (k,)
            if (s - 1, s) not in takes:
                raise ValueError(f"{self.name}: stage {s} takes nothing from stage {s - 1}; move the split points")
        skips = tuple(sorted(pair for pair in takes if pair[1] > pair[0] + 1))
        graphs = []
        used: dict[str, int] = {}
        for s, node in enumerate(stage_nodes):
            module = pipe.split_gm.get_submodule(node.target)
            self._check_modules(module, s, used)
            graph = copy.deepcopy(module.graph)
            keywords = keyword_placeholders(graph, named[s])
            check_keyword_reads(graph, keywords, f"{self.name}: stage {s}", ADVICE)
            if s > 0:
                _order_placeholders(graph, sources[s], _input_order(s, takes, skips), keywords)
            graphs.append(graph)
        per_sample = tuple(tuple(dict.fromkeys(n.values())) for n in named)
        return TracedSplit(tuple(graphs), skips, takes, per_sample)

    def _source(self, arg, stage_of: dict, consumer: int) -> tuple[int, int]:
        """(producer stage, index of its output) of one input of stage `consumer`."""
        if isinstance(arg, fx.Node) and arg in stage_of:
            return stage_of[arg], 0
        if (
            isinstance(arg, fx.Node)
            and arg.op == "call_function"
            and arg.target is operator.getitem
            and arg.args[0] in stage_of
        ):
            return stage_of[arg.args[0]], int(arg.args[1])
        if isinstance(arg, fx.Node) and arg.op == "placeholder":
            raise ValueError(
                f"{self.name}: stage {consumer} reads the model's input {arg.name!r}; only the first stage takes the "
                "model's inputs: move the split points so that it is read before the first of them"
            )
        raise ValueError(f"{self.name}: stage {consumer} takes {arg!r}, which mesh3d cannot route between stages")

    def _check_modules(self, stage: fx.GraphModule, index: int, used: dict[str, int]) -> None:
        """Every module the stage calls is a module of the model, whole, and in no other stage."""
        for node in stage.graph.nodes:
            if node.op != "call_module":
                continue
            target = str(node.target)
            try:
                original = self.meta_model.get_submodule(target)
            except AttributeError:
                raise ValueError(
                    f"{self.name}: stage {index} calls {target!r}, which is not a module of the model"
                ) from None
            kept = {n for n, _ in stage.get_submodule(target).named_parameters()}
            whole = {n for n, _ in original.named_parameters()}
            if kept != whole:
                raise ValueError(
                    f"{self.name}: a split point falls inside module {target!r} (stage {index} holds "
                    f"{len(kept)} of its {len(whole)} parameters); split points must name blocks the forward "
                    "calls whole"
                )
            if used.setdefault(target, index) != index:
                raise ValueError(
                    f"{self.name}: module {target!r} runs in stages {used[target]} and {index}; share Parameters "
                    "between stages (ties are supported), not whole modules"
                )


def _unannotate(model: nn.Module, starts: Sequence[str]) -> None:
    """Undo what torch's pipeline() does to the model in place: each split point's module given a
    `forward` that marks the split, calling the one kept as `_orig_forward`. Left there, the model
    (the caller's own, when given on meta) would mark splits in a later capture of other split
    points, or of another microbatch shape (the planner's), and wrap the marker in itself again."""
    for start in starts:
        try:
            module = model.get_submodule(start)
        except AttributeError:  # a name that is no module: pipeline() failed on it, and its error stands
            continue
        if "_orig_forward" in module.__dict__:
            original = module.__dict__.pop("_orig_forward")
            module.__dict__.pop("forward", None)
            if getattr(original, "__self__", None) is not module or original.__func__ is not type(module).forward:
                module.forward = original  # an instance forward the model had set itself stays


def _input_order(stage: int, takes: dict, skips: tuple) -> list[tuple[int, int]]:
    """The runtime's input order (pipeline/routes.py): the previous stage's outputs, then each
    skip producer's in stage order, each in the order its `takes` lists them."""
    producers = [stage - 1] + [p for p, c in skips if c == stage]
    return [(p, k) for p in producers for k in takes[(p, stage)]]


def _order_placeholders(
    graph: fx.Graph, sources: list[tuple[int, int]], order: list[tuple[int, int]], keywords: set[str]
) -> None:
    """Put the stage graph's routed inputs in the runtime's order, before its keyword inputs; an
    input taken twice becomes one."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder" and n.target not in keywords]
    first: dict[tuple[int, int], fx.Node] = {}
    for node, source in zip(placeholders, sources):
        if source in first:
            node.replace_all_uses_with(first[source])
            graph.erase_node(node)
        else:
            first[source] = node
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    for source in order:
        anchor.prepend(first[source])
    keywords_last(graph, keywords)


def _is_input(arg) -> bool:
    return isinstance(arg, fx.Node) and arg.op == "placeholder"


def _well_formed(example_inputs) -> bool:
    """(tensor,) or (tensor, {str: tensor})."""
    if not isinstance(example_inputs, tuple) or len(example_inputs) not in (1, 2):
        return False
    if not isinstance(example_inputs[0], torch.Tensor):
        return False
    if len(example_inputs) == 1:
        return True
    named = example_inputs[1]
    return isinstance(named, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in named.items())


def _meta_copy(model: nn.Module) -> nn.Module:
    return model if all(t.is_meta for t in [*model.parameters(), *model.buffers()]) else meta_copy(model)


def _describe(value) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__
