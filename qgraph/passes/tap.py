"""Make located nodes extra outputs of the program."""
from __future__ import annotations

import torch
from torch.fx import Graph, Node

from .locate import Found


def tap(graph: Graph, found: dict[str, Found]) -> list[str]:
    """Append each found value to the program's outputs; return their names in output order.

    A value with ``split_heads`` is tapped as a view ``[..., heads, head_dim]`` of its node.
    """
    output = graph.output_node()
    taps: list[Node] = []
    for location in found.values():
        node = location.node
        if location.split_heads:
            with graph.inserting_before(output):
                node = graph.call_function(torch.ops.aten.unflatten.int, (node, -1, list(location.split_heads)))
        taps.append(node)
    outputs = tuple(output.args[0])
    output.args = (outputs + tuple(taps),)
    return list(found)
