"""A (pruned) ``AttributionGraph`` as a ``graphviz.Digraph``, laid out for a paper figure (PNG, SVG, PDF).

dot's own layout suits a pruned attribution graph badly: an edge from a token to a logit crosses every
layer, and dot gives it a slot in each, so a few hundred such edges made the tiny model's graph 18,000
pixels wide. Here qgraph places the nodes itself and Graphviz's ``neato`` only routes the edges around
them (``pos="x,y!"``): a band per layer (the prompt at the bottom, the logits on top), each node above
its token's place in a band ``width`` nodes wide; a layer with more nodes than fit wraps onto a second
band. Tokens are written as text ('␣' a space), logits with their probability, features with their label
(or layer and index) over their token. Edges are blue when positive and red when negative, wider with
their magnitude; every node and edge has a tooltip (its facts, its weight) in the SVG.
"""
from __future__ import annotations

from .layout import FILLS, NEGATIVE, POSITIVE, cut, describe, edges, logit_name, probability, row, \
    row_name, short_label, token, visible

__all__ = ["NEGATIVE", "POSITIVE", "digraph"]

WIDTH = 10  # nodes across a band, about
CHAR, PAD, GAP, NODE = 6.0, 14.0, 8.0, 66.0  # points: a character at 10 pt, a box's padding, between boxes, a box
BAND, LAYER = 40.0, 58.0  # points between the bands of a layer, between layers
SHAPES = {"feature": "ellipse", "error": "box", "embedding": "box", "logit": "box"}


def _label(graph, i: int, labels) -> str:
    """A node's text: a feature's label (or layer and index) over its token; an error's place; a token; a
    logit's token and probability."""
    node = graph.nodes[i]
    where = f"{visible(token(graph, node.position), 10)} @{node.position}"
    if node.kind == "embedding":
        return visible(token(graph, node.position), 12)
    if node.kind == "logit":
        return f"{logit_name(graph, i)}\np={probability(graph, i):.2f}"
    if node.kind == "error":
        return f"error\n{where}"
    return f"{cut(short_label(graph, i, labels), 24)}\n{where}"


def _size(graph, i: int, text: str) -> float:
    """About how wide node ``i`` is drawn, in points (an ellipse is wider than its text's box)."""
    wide = CHAR * max(map(len, text.split("\n"))) + PAD
    return wide * 1.4 if graph.nodes[i].kind == "feature" else wide


def _bands(graph, members: list[int], sizes: dict[int, float], span: float) -> list[list[tuple[int, float]]]:
    """A layer's nodes, in token order, as bands of (node, x) no wider than ``span``: each node as near its
    token's place as its neighbours in the band allow."""
    seq = len(graph.input_ids)
    bands: list[list[int]] = [[]]
    used = 0.0
    for i in sorted(members, key=lambda i: (graph.nodes[i].position, graph.nodes[i].kind == "error")):
        if bands[-1] and used + GAP + sizes[i] > span:
            bands.append([])
            used = 0.0
        bands[-1].append(i)
        used += sizes[i] + (GAP if len(bands[-1]) > 1 else 0.0)
    placed = []
    for band in bands:
        xs = [span * (graph.nodes[i].position + 0.5) / seq for i in band]
        for k in range(len(band)):  # left to right: no overlap with the one before
            low = sizes[band[0]] / 2 if k == 0 else xs[k - 1] + (sizes[band[k - 1]] + sizes[band[k]]) / 2 + GAP
            xs[k] = max(xs[k], low)
        for k in reversed(range(len(band))):  # right to left: inside the span
            high = span - sizes[band[k]] / 2 if k == len(band) - 1 else \
                xs[k + 1] - (sizes[band[k + 1]] + sizes[band[k]]) / 2 - GAP
            xs[k] = min(xs[k], high)
        placed.append(list(zip(band, xs)))
    return placed


def digraph(graph, labels, width: int = WIDTH):
    """The graph as a ``graphviz.Digraph`` drawn by ``neato``: node ``n{i}`` for node ``i`` at a position qgraph
    chose (a band per layer, at most about ``width`` nodes across), the edges routed around the nodes."""
    from ..render.engine import Digraph  # the system's Graphviz, else pygraphviz's bundled one

    prompt = graph.prompt if graph.prompt is not None else "".join(graph.tokens or [])
    g = Digraph("attribution_graph", engine="neato")
    g.attr(splines="curved", sep="+2", outputorder="edgesfirst", fontname="Helvetica", fontsize="12", labelloc="t",
           label=f"Attribution graph · “{cut(prompt, 80)}”\n"
                 f"edges: blue positive, red negative, width by |weight|")
    g.attr("node", fontname="Helvetica", fontsize="10", style="filled", margin="0.05,0.02", height="0.3",
           penwidth="0.8")
    g.attr("edge", arrowsize="0.45")
    texts = {i: _label(graph, i, labels) for i in range(len(graph.nodes))}
    sizes = {i: _size(graph, i, text) for i, text in texts.items()}
    span = width * NODE
    rows: dict[int, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        rows.setdefault(row(graph, node), []).append(i)
    y = 0.0
    for r in range(graph.n_layers + 2):
        bands = _bands(graph, rows.get(r, []), sizes, span)
        g.node(f"row_{r}", row_name(graph, r), shape="plaintext", style="", fontcolor="#666666",
               pos=f"{-40 / 72:.3f},{(y + BAND * (len(bands) - 1) / 2) / 72:.3f}!")
        for band in bands:
            for i, x in band:
                node = graph.nodes[i]
                g.node(f"n{i}", texts[i], shape=SHAPES[node.kind], fillcolor=FILLS[node.kind],
                       width=f"{sizes[i] / 72:.2f}", tooltip=describe(graph, i, labels, {}),
                       pos=f"{x / 72:.3f},{y / 72:.3f}!")
            y += BAND
        y += LAYER - BAND
    for s, t, w, share in edges(graph)[0]:
        alpha = f"{round(255 * (0.3 + 0.6 * share)):02x}"
        g.edge(f"n{s}", f"n{t}", color=(POSITIVE if w >= 0 else NEGATIVE) + alpha, penwidth=f"{0.4 + 3.2 * share:.2f}",
               tooltip=f"{graph.nodes[s].node_id} → {graph.nodes[t].node_id}: {w:.4g}")
    return g
