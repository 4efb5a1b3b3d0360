"""Remove the port markers that ``qgraph.export`` put around module inputs and outputs."""
from __future__ import annotations

from torch.fx import Graph

from ..kernels.ops import MARK_OP
from .base import GraphPass, PassResult


def strip_markers(graph: Graph) -> Graph:
    """Rewire every marker's users (taps included) to the marked tensor and delete the marker."""
    for node in list(graph.nodes):
        if node.target is MARK_OP:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    return graph


class StripMarkers(GraphPass):
    """``strip_markers`` as a pass (the last rewrite before a program runs)."""

    def call(self, graph_module) -> PassResult:
        strip_markers(graph_module.graph)
        return PassResult(graph_module, True)
