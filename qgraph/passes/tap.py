"""Make located nodes outputs of the program, and drop what no output needs."""
from __future__ import annotations

from torch.fx import Graph, Node

from . import views
from .base import GraphPass, PassResult
from .locate import Found


def tap(graph: Graph, found: dict[str, Found]) -> list[str]:
    """Append each found value to the program's outputs; return their names in output order.

    A value with a ``view`` is tapped as that view of its node.
    """
    output = graph.output_node()
    taps: list[Node] = [views.emit(graph, location.node, location.view) for location in found.values()]
    outputs = tuple(output.args[0])
    output.args = (outputs + tuple(taps),)
    return list(found)


class Tap(GraphPass):
    """Tap ``found`` and keep, of the model's own outputs, the logits (its first) or none; ``tapped``
    holds the tapped names in output order after it ran."""

    def __init__(self, found: dict[str, Found], logits: bool):
        self.found, self.logits, self.tapped = found, logits, []

    def call(self, graph_module) -> PassResult:
        output = graph_module.graph.output_node()
        model_outputs = len(output.args[0])
        self.tapped = tap(graph_module.graph, self.found)
        kept = (output.args[0][0],) if self.logits else ()
        output.args = (kept + tuple(output.args[0])[model_outputs:],)
        return PassResult(graph_module, True)


class Prune(GraphPass):
    """Drop every node no output needs (and the model's own work past the last value tapped). Edit
    slots are pure: an unread one goes too."""

    def call(self, graph_module) -> PassResult:
        modified = graph_module.graph.eliminate_dead_code(
            is_impure_node=lambda node: node.op != "call_module" and node.is_impure())
        if modified:
            graph_module.delete_all_unused_submodules()
        return PassResult(graph_module, modified)
