"""Remove the port markers that ``qgraph.export`` put around module inputs and outputs."""
from __future__ import annotations

from ..errors import InternalError
from ..kernels.ops import MARK_OP
from .base import BuildPass, PassResult, has_markers


class StripMarkers(BuildPass):
    """Rewire every marker's users (taps included) to the marked tensor and delete the marker: the
    last rewrite that reads them."""

    markers = True

    def call(self, graph_module) -> PassResult:
        graph = graph_module.graph
        for node in list(graph.nodes):
            if node.target is MARK_OP:
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
        return PassResult(graph_module, True)

    def ensures(self, graph_module) -> None:
        if has_markers(graph_module):
            raise InternalError("port markers remain after StripMarkers")
