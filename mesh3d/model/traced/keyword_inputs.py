"""A traced stage's per-sample inputs: the graph inputs besides the tokens (a mask, position ids)
that the example inputs name, taken by each stage that reads them as keyword parameters of those
names, so the runtime hands them from the step's batch (model/stage_inputs.py) instead of routing
them between stages."""

from __future__ import annotations

from torch import fx


def keyword_placeholders(graph: fx.Graph, named: dict[int, str]) -> set[str]:
    """The per-sample inputs among the stage graph's inputs (by position: `named`) renamed to their
    names, so the stage takes them by keyword (an input read twice becomes one); returns the names."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    kept: dict[str, fx.Node] = {}
    for index, name in named.items():
        node = placeholders[index]
        if name in kept:
            node.replace_all_uses_with(kept[name])
            graph.erase_node(node)
            continue
        node.target = name
        kept[name] = node
    keywords_last(graph, set(kept))
    return set(kept)


def keywords_last(graph: fx.Graph, keywords: set[str]) -> None:
    """The keyword inputs after every positional one (their order kept)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = placeholders[-1] if placeholders else None
    for node in [n for n in placeholders if n.target in keywords]:
        if node is not last:
            last.append(node)
            last = node
    graph.lint()


def check_keyword_reads(graph: fx.Graph, keywords: set[str], where: str, advice: str) -> None:
    """A module called with a per-sample input and anything else is refused: torch's frontend
    orders a module's inputs as its graph produced them, not as its forward lists them, and a
    stage calls the module's own forward (one input alone has no order to lose)."""
    for node in graph.nodes:
        given = node.all_input_nodes if node.op == "call_module" else []
        read = [a.target for a in given if a.op == "placeholder" and a.target in keywords]
        if read and len(given) > 1:
            raise ValueError(
                f"{where}: module {str(node.target)!r} is called with the per-sample input(s) {read} and "
                f"{len(given) - len(read)} other input(s); a traced stage cannot tell their order. Use a per-sample "
                f"input in the model's own forward, or in a module that takes it alone, or {advice}"
            )
