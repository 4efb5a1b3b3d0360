"""Circuits: attribution graphs through the replacement model (transcoders at every MLP, the model
frozen around them: ``passes.replacement``), in circuit-tracer's conventions (``graph.py``)."""
from .attribute import attribution_graph
from .estimate import Estimate, estimate
from .graph import AttributionGraph, Node

__all__ = ["AttributionGraph", "Estimate", "Node", "attribution_graph", "estimate"]
