"""How much of a graph's influence on the logits its features carry: circuit-tracer's
``compute_graph_scores`` (``circuit_tracer/graph.py``, 0.5.0) on an ``AttributionGraph``.

With ``A`` the ``|adjacency|`` with its rows normalised (``influence._normalized``) and ``w`` the logit
probabilities on the logit nodes, each node's influence is ``w @ (A + A^2 + ...)`` (``influence._influence``):

- replacement score: the embeddings' influence over the embeddings' and the errors' together (what
  reaches the logits from the tokens through features alone);
- completeness score: each node's share of incoming (normalised) weight not from error nodes, averaged
  with the weights ``influence + w``.

circuit-tracer finds the kinds by slicing (features, then every error node, then the tokens); here they
are found by kind, so a pruned graph (a subset of the error nodes) scores as circuit-tracer scores a
pruned graph: its full adjacency with the pruned nodes and edges zeroed (the nodes pruned carry no
influence and no weight). A graph with no influence from the tokens or errors scores nan, as there.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .influence import influence_from, row_normalized


class GraphScores(NamedTuple):
    """``(replacement, completeness)``: circuit-tracer's replacement and completeness scores."""

    replacement: float
    completeness: float


def graph_scores(graph) -> GraphScores:
    """circuit-tracer's ``compute_graph_scores`` of ``graph`` (an ``AttributionGraph``, pruned or not)."""
    adjacency = graph.adjacency
    weights = torch.zeros(len(graph.nodes), device=adjacency.device)
    weights[graph.kind_mask("logit")] = graph.logit_probabilities.to(adjacency.device)
    normalized = row_normalized(adjacency)
    influence = influence_from(normalized, weights)
    errors = graph.kind_mask("error")
    tokens = influence[graph.kind_mask("embedding")].sum()
    replacement = tokens / (tokens + influence[errors].sum())
    non_error = 1 - normalized[:, errors].sum(dim=-1)
    output = influence + weights
    completeness = (non_error * output).sum() / output.sum()
    return GraphScores(replacement.item(), completeness.item())
