"""Influence through an attribution graph, as circuit-tracer computes it (``normalize_matrix`` and
``compute_influence`` in ``circuit_tracer/graph.py``): what pruning ranks nodes by and the scores read."""
from __future__ import annotations

import torch

from ..errors import InvalidArgument


def influence(adjacency: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each node's influence on the nodes ``weights`` weighs (the logits, by probability): ``weights @ (A +
    A^2 + ...)`` with ``A`` the ``|adjacency|`` with its rows normalised (what ``prune`` ranks nodes by)."""
    return influence_from(row_normalized(adjacency), weights)


def row_normalized(adjacency: torch.Tensor) -> torch.Tensor:
    """``|adjacency|`` with each row (target) scaled to sum to 1 (rows of zeros stay zero)."""
    magnitude = adjacency.abs()
    return magnitude / magnitude.sum(dim=1, keepdim=True).clamp(min=1e-10)


def influence_from(normalized: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weights @ (A + A^2 + ...)``: an acyclic graph's ``A`` is nilpotent, so at most n terms are nonzero."""
    step = weights @ normalized
    total = step.clone()
    for _ in range(normalized.shape[0]):
        if not step.any():
            return total
        step = step @ normalized
        total += step
    raise InvalidArgument("the adjacency has a cycle (a node influences itself): influence does not converge")
