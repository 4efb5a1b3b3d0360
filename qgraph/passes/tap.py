"""Make located nodes extra outputs of the program."""
from __future__ import annotations

from torch.fx import Graph, Node

from . import views
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
