"""The result of an attribution: nodes, the direct effect of each on each other, and pruning by influence.

The conventions are circuit-tracer's (safety-research/circuit-tracer, 0.5.0 on PyPI), so that a graph
compares with the reference implementation and opens in its viewer and in Neuronpedia's:

- node order (``circuit_tracer/graph.py``, ``Graph``): active features (by layer, position, feature),
  error nodes (layer-major, one per (layer, position)), embedding nodes (one per position), logit nodes
  (most likely first);
- ``adjacency[t, s]`` is the direct effect of source ``s`` on target ``t`` (rows are targets);
- pruning (``prune_graph`` there): influence on the logits through the row-normalised ``|adjacency|``,
  nodes kept up to a share of the total influence, then edges by their share of edge influence; every
  embedding and logit node is kept;
- the JSON file (``graphfile.py``: ``circuit_tracer/utils/create_graph_files.py`` and the pydantic models
  of ``circuit_tracer/frontend/graph_models.py``): node ids (an error node's as circuit-tracer fixed them
  after 0.5.0, one node's each: ``Node.node_id``), ``feature_type`` strings, metadata, links; read back
  by ``from_json``, from either tool.

The views (``to_json``, ``plot`` and ``show``: the viewer, ``to_graphviz``) show a pruned graph: one not
yet pruned is pruned first, with the thresholds given (circuit-tracer's defaults, 0.8 and 0.98, otherwise).
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from collections.abc import Mapping, Sequence

import torch

from ..errors import InvalidArgument, InvalidType, OutOfRange
from . import graphfile
from .influence import influence_from, row_normalized, influence
from .nodes import FEATURE_TYPES, KINDS, Node

__all__ = ["FEATURE_TYPES", "KINDS", "AttributionGraph", "Node", "influence"]

NODE_THRESHOLD, EDGE_THRESHOLD = 0.8, 0.98  # circuit-tracer's defaults (create_graph_files)


class AttributionGraph:
    """Nodes in circuit-tracer's order and the direct effects between them (``adjacency[target, source]``).

    ``node_inputs[i]``: what node ``i`` is attributed (a feature's pre-activation, a logit node's logit
    minus the mean logit; 0 for error and embedding nodes). ``constants[i]``: what no node accounts for
    (encoder bias, decoder biases carried forward). ``tokens`` / ``logit_tokens``: decoded strings.
    ``scan``: the name of the transcoders (circuit-tracer's ``scan``). A pruned graph also has ``edges``
    (the kept edges), ``node_influence`` (each node's influence on the logits), ``pruned`` (its
    thresholds) and ``kept`` (each node's index in the graph it was pruned from). ``labels``:
    ``{(layer, feature): text}`` naming features (a graph file's ``clerp``), which ``to_json`` writes and
    the views show.
    """

    def __init__(self, nodes: Sequence[Node], adjacency: torch.Tensor, node_inputs: torch.Tensor,
                 constants: torch.Tensor, input_ids: torch.Tensor, logit_probabilities: torch.Tensor,
                 tokens: Sequence[str] | None = None, logit_tokens: Sequence[str] | None = None,
                 scan: str | Sequence[str] | None = None, n_layers: int | None = None, *, prompt: str | None = None,
                 edges: torch.Tensor | None = None, node_influence: torch.Tensor | None = None,
                 pruned: tuple[float | None, float | None] | None = None, kept: torch.Tensor | None = None,
                 labels: Mapping[tuple[int, int], str] | None = None):
        self.nodes = list(nodes)
        if not all(isinstance(node, Node) for node in self.nodes):
            raise InvalidType("AttributionGraph takes a list of qgraph Node objects")
        tensors = dict(adjacency=adjacency, node_inputs=node_inputs, constants=constants, input_ids=input_ids,
                       logit_probabilities=logit_probabilities)
        for name, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise InvalidType(f"{name} is a torch.Tensor, not {type(value).__name__}")
        self.adjacency = adjacency.float()
        self.node_inputs, self.constants = node_inputs.float(), constants.float()
        self.input_ids = input_ids.reshape(-1)
        self.logit_probabilities = logit_probabilities.float()
        self.tokens = None if tokens is None else list(tokens)
        self.logit_tokens = None if logit_tokens is None else list(logit_tokens)
        self.scan = scan
        self.prompt = prompt
        self.edges = edges
        self.node_influence = node_influence
        self.pruned = pruned
        self.kept = kept
        self.labels = dict(labels or {})
        self.n_layers = self._check(n_layers)
        self._index: dict | None = None

    def _check(self, n_layers: int | None) -> int:
        n, seq = len(self.nodes), len(self.input_ids)
        if self.adjacency.shape != (n, n):
            raise InvalidArgument(f"adjacency is [n, n] for {n} nodes, not {list(self.adjacency.shape)}")
        for name in ("node_inputs", "constants"):
            if getattr(self, name).shape != (n,):
                raise InvalidArgument(f"{name} is [n] for {n} nodes, not {list(getattr(self, name).shape)}")
        if not torch.isfinite(self.adjacency).all():
            raise InvalidArgument("adjacency has entries that are not finite (inf or nan)")
        ranks = [KINDS.index(node.kind) for node in self.nodes]
        if any(a > b for a, b in zip(ranks, ranks[1:])):
            raise InvalidArgument("nodes go in circuit-tracer's order: features, then errors, then embeddings, "
                                  "then logits")
        if self.edges is not None and self.edges.shape != (n, n):
            raise InvalidArgument(f"edges is [n, n] for {n} nodes, not {list(self.edges.shape)}")
        if len(self.logit_probabilities) != self.count("logit"):
            raise InvalidArgument(f"{len(self.logit_probabilities)} logit probabilities for "
                                  f"{self.count('logit')} logit nodes")
        if self.tokens is not None and len(self.tokens) != seq:
            raise InvalidArgument(f"{len(self.tokens)} tokens for {seq} input ids")
        if self.logit_tokens is not None and len(self.logit_tokens) != self.count("logit"):
            raise InvalidArgument(f"{len(self.logit_tokens)} logit tokens for {self.count('logit')} logit nodes")
        outside = [node for node in self.nodes if not 0 <= node.position < seq]
        if outside:
            raise OutOfRange(f"node {outside[0]} is at a position outside the {seq} input tokens")
        layered = [(node.kind, node.layer) for node in self.nodes if node.layer is not None]  # all but embeddings
        logit_layers = {layer for kind, layer in layered if kind == "logit"}
        if n_layers is None:
            blocks = [layer + 1 for kind, layer in layered if kind in ("feature", "error")]
            n_layers = logit_layers.pop() if logit_layers else max(blocks, default=0)
        if logit_layers - {n_layers}:
            raise InvalidArgument(f"a logit node's layer is the number of blocks ({n_layers}), not "
                                  f"{sorted(logit_layers - {n_layers})}")
        return n_layers

    # -- what is in it ------------------------------------------------------------------------------
    def count(self, kind: str) -> int:
        """How many nodes of one kind ("feature", "error", "embedding", "logit")."""
        return sum(node.kind == kind for node in self.nodes)

    def kind_mask(self, *kinds: str) -> torch.Tensor:
        """[n] bool: the nodes of these kinds."""
        return torch.tensor([node.kind in kinds for node in self.nodes], dtype=torch.bool,
                            device=self.adjacency.device)

    @property
    def edge_mask(self) -> torch.Tensor:
        """[n, n] bool: the edges (those pruning kept; every nonzero entry of an unpruned graph)."""
        return self.adjacency != 0 if self.edges is None else self.edges

    def node_index(self, kind: str, layer: int | None, position: int, feature: int | None = None) -> int:
        """The index of a node (``layer`` is not looked at for embeddings and logits)."""
        if self._index is None:
            self._index = {_key(node.kind, node.layer, node.position, node.feature): i
                           for i, node in enumerate(self.nodes)}
        key = _key(kind, layer, position, feature)
        if key not in self._index:
            raise OutOfRange(f"no {kind} node at layer={layer}, position={position}, feature={feature} in this graph")
        return self._index[key]

    def __repr__(self) -> str:
        return (f"AttributionGraph({self.count('feature')} features, {self.count('error')} errors, "
                f"{len(self.input_ids)} tokens, {self.count('logit')} logits, {int(self.edge_mask.sum())} edges)")

    def scores(self):
        """circuit-tracer's ``(replacement, completeness)`` scores of this graph (``circuits.scores``)."""
        # lazy: qgraph.circuits.scores imports this module's package at import time (a cycle)
        from .scores import graph_scores
        return graph_scores(self)

    # -- pruning -------------------------------------------------------------------------------------
    def prune(self, node_threshold: float = NODE_THRESHOLD, edge_threshold: float = EDGE_THRESHOLD
              ) -> AttributionGraph:
        """The nodes and edges that carry most of the influence on the logits, as circuit-tracer's
        ``prune_graph`` and ``create_used_nodes_and_edges`` choose them.

        Influence: with ``A`` the adjacency with ``|.|`` rows normalised to sum to 1 and ``w`` the logit
        probabilities on the logit nodes, ``w @ (A + A^2 + ...)``. Nodes are kept, most influential
        first, until their share of the total influence reaches ``node_threshold``; every embedding and
        logit node is kept. Edges among those are scored by ``A'[t, s] * (influence'(t) + w[t])`` on the
        adjacency ``A'`` restricted to them, and kept up to ``edge_threshold`` of the total score. Then
        features and errors with no outgoing edge, and features with no incoming edge, go (repeatedly),
        and so does any feature or error left without an edge. The new graph's adjacency has the pruned
        edges zeroed; each node's ``influence`` is circuit-tracer's cumulative score.
        """
        for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
            if not 0.0 <= value <= 1.0:
                raise InvalidArgument(f"{name}={value}: a share of the total influence, from 0.0 to 1.0")
        adjacency = self.adjacency
        weights = torch.zeros(len(self.nodes), device=adjacency.device)
        weights[self.kind_mask("logit")] = self.logit_probabilities.to(adjacency.device)

        influence = influence_from(row_normalized(adjacency), weights)
        always = self.kind_mask("embedding", "logit")
        kept = (influence >= _threshold(influence, node_threshold)) | always

        normalized = row_normalized(adjacency * (kept[:, None] & kept[None, :]))
        edge_scores = normalized * (influence_from(normalized, weights) + weights)[:, None]
        # a score of 0 is no edge (circuit-tracer keeps those too when its threshold falls to 0, at 1.0)
        edges = (edge_scores >= _threshold(edge_scores.flatten(), edge_threshold)) & (edge_scores > 0)

        inner, features = self.kind_mask("feature", "error"), self.kind_mask("feature")
        while True:  # each node gone may leave others without an edge
            before = kept.clone()
            kept[inner] &= edges[:, inner].any(0)  # features and errors: an outgoing edge
            kept[features] &= edges[features].any(1)  # features: an incoming edge
            if torch.equal(before, kept):
                break
            edges &= kept[:, None] & kept[None, :]
        edges &= kept[:, None] & kept[None, :]
        kept &= always | edges.any(0) | edges.any(1)  # what create_used_nodes_and_edges writes

        ordered, order = torch.sort(influence, descending=True, stable=True)
        cumulative = torch.zeros_like(influence)
        if ordered.sum() > 0:  # else nothing has influence: every node is at the tail, 1.0
            cumulative[order] = torch.cumsum(ordered, 0) / ordered.sum()
        else:
            cumulative.fill_(1.0)

        index = kept.nonzero().flatten()
        nodes = [replace(self.nodes[i], influence=None if self.nodes[i].kind == "logit" else float(cumulative[i]))
                 for i in index.tolist()]
        sub_edges = edges[index][:, index]
        sub_adjacency = torch.where(sub_edges, adjacency[index][:, index], torch.zeros((), device=adjacency.device))
        pick = lambda values: values[index.to(values.device)]  # noqa: E731 (node_inputs may be elsewhere)
        return AttributionGraph(
            nodes, sub_adjacency, pick(self.node_inputs), pick(self.constants), self.input_ids,
            self.logit_probabilities, self.tokens, self.logit_tokens, self.scan, self.n_layers, prompt=self.prompt,
            edges=sub_edges, node_influence=influence[index], pruned=(node_threshold, edge_threshold),
            kept=index.cpu() if self.kept is None else pick(self.kept), labels=self.labels)

    def _as_pruned(self, node_threshold: float | None, edge_threshold: float | None) -> AttributionGraph:
        if self.pruned is None:
            return self.prune(NODE_THRESHOLD if node_threshold is None else node_threshold,
                              EDGE_THRESHOLD if edge_threshold is None else edge_threshold)
        asked = (node_threshold if node_threshold is not None else self.pruned[0],
                 edge_threshold if edge_threshold is not None else self.pruned[1])
        if asked != tuple(self.pruned):
            raise InvalidArgument(f"this graph is pruned already (node_threshold={self.pruned[0]}, edge_threshold="
                                  f"{self.pruned[1]}): prune the full graph with the thresholds you want")
        return self

    # -- views ---------------------------------------------------------------------------------------
    def json_data(self, slug: str = "qgraph", *, scan: str | Sequence[str] | None = None, prompt: str | None = None,
                  labels: Mapping[tuple[int, int], str] | None = None, node_threshold: float | None = None,
                  edge_threshold: float | None = None) -> dict:
        """The graph file's content as a dict (see ``to_json``)."""
        return graphfile.json_data(self._as_pruned(node_threshold, edge_threshold), slug, scan, prompt, labels or {})

    def to_json(self, path: str | Path, slug: str = "qgraph", *, scan: str | Sequence[str] | None = None,
                prompt: str | None = None, labels: Mapping[tuple[int, int], str] | None = None,
                node_threshold: float | None = None, edge_threshold: float | None = None) -> Path:
        """Write the graph in circuit-tracer's and Neuronpedia's graph format (``create_graph_files``).

        ``path``: a ``.json`` file, or a folder: then ``<slug>.json`` is written there and the graph's
        metadata is added to the folder's ``graph-metadata.json``, which circuit-tracer's local server
        lists. ``scan``: the transcoders' name (default ``self.scan``, else "qgraph"); a list of
        transcoders is named "custom-<hash>". ``labels``: ``{(layer, feature): text}``, written as the
        features' ``clerp`` (over ``self.labels``). A graph not yet pruned is pruned first with the
        thresholds given. Returns the path written.
        """
        data = self.json_data(slug, scan=scan, prompt=prompt, labels=labels, node_threshold=node_threshold,
                              edge_threshold=edge_threshold)
        return graphfile.write(data, Path(path), slug)

    @classmethod
    def from_json(cls, path: str | Path, *, max_bytes: int = graphfile.MAX_BYTES, max_nodes: int = graphfile.MAX_NODES,
                  max_links: int = graphfile.MAX_LINKS) -> AttributionGraph:
        """The graph in a circuit-tracer / Neuronpedia graph file (what ``to_json`` and circuit-tracer's
        ``create_graph_files`` write), to view (``.show()``), prune further or score.

        The file is untrusted input: one over ``max_bytes``, ``max_nodes`` or ``max_links`` is refused before
        it is parsed or built (the adjacency is dense, nodes² float32), and every field is checked. The graph
        is pruned already (``pruned``: the file's node threshold, and None for the edge threshold it does not
        record); the features' ``clerp`` are its ``labels``; ``node_inputs`` and ``constants``, which a file
        does not hold, are nan. Errors are ``InvalidArgument`` naming the file, the entry and the problem.
        """
        return graphfile.read(cls, path, max_bytes, max_nodes, max_links)

    def plot(self, *, labels: Mapping[tuple[int, int], str] | None = None,
             top_logits: Mapping[tuple[int, int], Sequence[str]] | None = None,
             node_threshold: float | None = None, edge_threshold: float | None = None):
        """The graph's viewer, one self-contained HTML page (inline SVG, CSS and JS; nothing from the network):
        tokens along the bottom, layers up, logits on top with their token and probability, features filled
        by influence; hover a node for its activation and its strongest edges with their weights, click to
        pin it and see only its neighbours, shift-click features and group them into a supernode, prune edges
        with the slider, search by layer or feature. ``labels`` (over ``self.labels``) and ``top_logits``
        (``{(layer, feature): ...}``) name features. Returns a ``Figure``: shown in a notebook,
        ``.save("g.html")``, ``.save("g.svg")`` or ``.save("g.png")``. A graph not yet pruned is pruned first."""
        # lazy: the viewer is read (and matplotlib loaded) only when a graph is drawn
        from .viewer import figure

        return figure(self._as_pruned(node_threshold, edge_threshold), labels or {}, top_logits or {})

    def show(self, **options):
        """``plot(**options)`` shown: in a notebook, in the cell; elsewhere written to a temporary ``.html``
        file and opened in the default web browser (its path is printed). Returns the ``Figure``."""
        # lazy: the viewer is read (and matplotlib loaded) only when a graph is drawn
        from .viewer import show

        return show(self.plot(**options))

    def to_graphviz(self, *, labels: Mapping[tuple[int, int], str] | None = None, width: int = 10,
                    node_threshold: float | None = None, edge_threshold: float | None = None):
        """The pruned graph as a ``graphviz.Digraph`` for a paper figure (``.source`` is the DOT; ``.pipe("png")``,
        ``.render(...)``): ranks by layer, nodes in token order, a layer wider than ``width`` nodes wrapped
        onto more ranks; the prompt's tokens as text along the bottom. A graph not yet pruned is pruned first."""
        # lazy: qgraph.circuits.render imports this module's package at import time (a cycle)
        from .render import digraph

        return digraph(self._as_pruned(node_threshold, edge_threshold), {**self.labels, **(labels or {})}, width)

def _key(kind: str, layer, position: int, feature) -> tuple:
    return (kind, position, feature) if kind in ("embedding", "logit") else (kind, layer, position, feature)


def _threshold(scores: torch.Tensor, share: float) -> torch.Tensor:
    """The smallest score kept when the highest scores are kept until they hold ``share`` of the total."""
    ordered = torch.sort(scores, descending=True).values
    total = ordered.sum()
    if ordered.numel() == 0 or total <= 0:
        return torch.tensor(math.inf, device=scores.device)  # nothing has influence: nothing kept by score
    cumulative = torch.cumsum(ordered, 0) / total
    at = int(torch.searchsorted(cumulative, share).item())
    return ordered[min(at, len(ordered) - 1)]
