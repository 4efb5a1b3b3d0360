"""Circuits: attribution graphs through the replacement model (transcoders at every MLP, the model
frozen around them: ``passes.replacement``), in circuit-tracer's conventions (``graph.py``); feature
interventions (``intervene.py``) and graph scores (``scores.py``) as circuit-tracer has them."""
from .attribute import attribution_graph
from .estimate import Estimate, estimate
from .graph import AttributionGraph, Node
from .intervene import Generated, Intervened, feature_intervention, feature_intervention_generate
from .scores import GraphScores, graph_scores

__all__ = ["AttributionGraph", "Estimate", "Generated", "GraphScores", "Intervened", "Node", "attribution_graph",
           "estimate", "feature_intervention", "feature_intervention_generate", "graph_scores"]
