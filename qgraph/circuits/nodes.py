"""A node of an attribution graph, as circuit-tracer has it: its kind, block, position and feature, and its
``node_id`` in circuit-tracer's graph files (``circuit_tracer/frontend/graph_models.py``, ``Node``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgument

__all__ = ["FEATURE_TYPES", "KINDS", "Node"]

KINDS = ("feature", "error", "embedding", "logit")  # also their order in a graph

# circuit-tracer's feature_type of each kind (frontend/graph_models.py, Node.feature_node ... logit_node)
FEATURE_TYPES = {"feature": "cross layer transcoder", "error": "mlp reconstruction error",
                 "embedding": "embedding", "logit": "logit"}


@dataclass(frozen=True)
class Node:
    """One node of an attribution graph.

    ``layer``: the block (feature, error); None for an embedding; the number of blocks for a logit.
    ``position``: the token position (circuit-tracer's ``ctx_idx``; a logit's is the last position).
    ``feature``: the transcoder feature (feature), the token id (embedding, logit), None (error).
    ``activation``: a feature's activation. ``probability``: a logit's. ``influence``: set by pruning,
    circuit-tracer's cumulative score (the share of the total influence held by the nodes at least as
    influential as this one: lower is more influential); None for logits and unpruned graphs.
    """
    kind: str
    layer: int | None
    position: int
    feature: int | None
    activation: float | None = None
    probability: float | None = None
    influence: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidArgument(f"Node kind {self.kind!r}: one of {', '.join(map(repr, KINDS))}")
        wants_layer = self.kind != "embedding"
        wants_feature = self.kind != "error"
        if (self.layer is not None) != wants_layer or (self.feature is not None) != wants_feature:
            raise InvalidArgument(
                f"a {self.kind} node has {'a' if wants_layer else 'no'} layer and {'a' if wants_feature else 'no'} "
                f"feature (feature index or token id): got layer={self.layer!r}, feature={self.feature!r}")

    @property
    def node_id(self) -> str:
        """circuit-tracer's ``node_id`` (Node.feature_node ... logit_node), one node's each: an error node's is
        ``{layer}_-1_{position}``, as circuit-tracer fixed it (0.5.0's ``0_{layer}_{position}`` was a feature's too)."""
        if self.kind == "feature":
            return f"{self.layer}_{self.feature}_{self.position}"
        if self.kind == "error":
            return f"{self.layer}_-1_{self.position}"
        if self.layer is None:  # an embedding, the one kind without a layer
            return f"E_{self.feature}_{self.position}"
        return f"{self.layer + 1}_{self.feature}_{self.position}"  # circuit-tracer draws logits at n_layers + 1
