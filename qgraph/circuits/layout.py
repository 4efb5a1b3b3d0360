"""Where each node of a (pruned) attribution graph is drawn and what it is called: shared by the viewer's
page (``viewer.py``), its PNG (``picture.py``) and the graphviz drawing (``render.py``).

Rows are the layers (the token embeddings at the bottom, the logits on top), columns the token
positions, as in circuit-tracer's and Neuronpedia's viewers; the nodes of one (layer, position) share
their cell, side by side. A column is as wide as its fullest cell needs, and the columns are spread to
fill at least ``MIN_WIDTH``. The logits (all read at the last position) have the top row to themselves,
spread across it; the rows are taller where there are few. Tokens are written visibly: a space is '␣',
a newline '↵', a tab '⇥'.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["NEGATIVE", "POSITIVE", "Layout", "cut", "describe", "influence_colour", "layout", "logit_name", "row",
           "short_label", "visible"]

POSITIVE, NEGATIVE = "#2166ac", "#b2182b"  # edges: ColorBrewer RdBu's ends
FILLS = {"feature": "#f6c25b", "error": "#bdbdbd", "embedding": "#9ecae1", "logit": "#a1d99b"}
WEAK, STRONG = (255, 243, 214), (217, 95, 2)  # a feature's fill, from the least to the most influential
LEFT, RIGHT, TOP, BOTTOM, MIN_WIDTH = 58, 24, 50, 40, 1000
SPACING = 17  # a node's share of its cell's width
MIN_COLUMN, LOGIT = 40, 24  # the narrowest column; the least room a logit gets in the top row
_SHOWN = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


def visible(token: str, limit: int | None = None) -> str:
    """A token as a reader sees it: whitespace as '␣' '↵' '⇥', other control characters as escapes,
    an empty token as '∅'; cut to ``limit`` characters with '…'."""
    return cut("".join(_SHOWN.get(c, c) for c in token) or "∅", limit)


def cut(text: str, limit: int | None = None) -> str:
    """Text on one line (a label, a prompt): control characters (a newline...) as escapes, cut to ``limit``
    characters with '…'."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if limit is None or len(text) <= limit else text[:limit - 1] + "…"


def row(graph, node) -> int:
    """The row a node is drawn in: 0 for embeddings, 1 + layer for features and errors, the top for logits."""
    if node.kind == "embedding":
        return 0
    if node.kind == "logit":
        return graph.n_layers + 1
    return node.layer + 1


def row_name(graph, r: int) -> str:
    return "tokens" if r == 0 else "logits" if r == graph.n_layers + 1 else f"L{r - 1}"


def token(graph, position: int) -> str:
    """The prompt's token at ``position`` (its id where the graph has no strings)."""
    return graph.tokens[position] if graph.tokens is not None else str(int(graph.input_ids[position]))


def logit_index(graph, i: int) -> int:
    """Node ``i``'s place among the logit nodes (they come last)."""
    return i - (len(graph.nodes) - graph.count("logit"))


def logit_token(graph, i: int) -> str:
    j = logit_index(graph, i)
    return graph.logit_tokens[j] if graph.logit_tokens is not None else str(graph.nodes[i].feature)


def logit_name(graph, i: int, limit: int = 14) -> str:
    """A logit node's token as shown, with its id where another logit's token looks the same (bytes that
    do not decode alone are all '\ufffd')."""
    shown = visible(logit_token(graph, i), limit)
    twins = sum(visible(logit_token(graph, k), limit) == shown for k in range(len(graph.nodes))
                if graph.nodes[k].kind == "logit")
    return f"{shown} #{graph.nodes[i].feature}" if twins > 1 else shown


def probability(graph, i: int) -> float:
    """A logit node's probability."""
    return float(graph.logit_probabilities[logit_index(graph, i)])


def short_label(graph, i: int, labels) -> str:
    """What a node is called beside it and in lists: a feature's label, else its layer and index."""
    node = graph.nodes[i]
    if node.kind == "feature":
        named = labels.get((node.layer, node.feature))
        return cut(named) if named else f"L{node.layer} F{node.feature}"
    if node.kind == "error":
        return f"error L{node.layer} @{node.position}"
    if node.kind == "embedding":
        return f"{visible(token(graph, node.position))} @{node.position}"
    return f"{logit_name(graph, i)} p={probability(graph, i):.3f}"


def describe(graph, i: int, labels, top_logits) -> str:
    """What hovering node ``i`` shows, one fact a line."""
    node = graph.nodes[i]
    where = f"position {node.position} ({visible(token(graph, node.position))})"
    if node.kind == "feature":
        lines = [f"feature {node.feature} · layer {node.layer} · {where}"]
        if node.activation is not None:
            lines.append(f"activation {node.activation:.4g}")
        if (node.layer, node.feature) in labels:
            lines.append(f"label: {cut(labels[node.layer, node.feature])}")
        if (node.layer, node.feature) in top_logits:
            lines.append("top logits: " + ", ".join(map(visible, top_logits[node.layer, node.feature])))
    elif node.kind == "error":
        lines = [f"error (what the transcoder misses) · layer {node.layer} · {where}"]
    elif node.kind == "embedding":
        lines = [f"token {visible(token(graph, node.position))} (id {node.feature}) · position {node.position}"]
    else:
        j = logit_index(graph, i)
        lines = [f"logit {visible(logit_token(graph, i))} (token {node.feature}) · "
                 f"p = {float(graph.logit_probabilities[j]):.4g}"]
    value = float(graph.node_inputs[i])
    if node.kind in ("feature", "logit") and math.isfinite(value):
        lines.append(f"{'pre-activation' if node.kind == 'feature' else 'logit - mean logit'} {value:.4g}")
    if node.influence is not None:
        lines.append(f"cumulative influence {node.influence:.3f}")
    lines.append(f"id {node.node_id}")
    return "\n".join(lines)


def influence_colour(node) -> str:
    """A feature's fill by its influence (circuit-tracer's cumulative score: 0 the most influential)."""
    if node.kind != "feature":
        return FILLS[node.kind]
    strength = 0.5 if node.influence is None else 1.0 - min(max(node.influence, 0.0), 1.0)
    return "#" + "".join(f"{round(w + (s - w) * strength):02x}" for w, s in zip(WEAK, STRONG))


@dataclass
class Layout:
    """Each node's (x, y), each position's column centre and each row's y, in a ``width`` x ``height`` box
    (the tokens' text 26 below the bottom row); ``slanted``: the logits are too close for flat labels."""
    points: list[tuple[float, float]]
    centres: list[float]
    rows: list[float]
    width: float
    height: float
    slanted: bool = False


def layout(graph) -> Layout:
    seq, n_rows = len(graph.input_ids), graph.n_layers + 2
    height = min(max(640 / n_rows, 30), 90)  # of a row
    cells: dict[tuple[int, int], list[int]] = {}
    logits = []
    for i, node in enumerate(graph.nodes):
        if node.kind == "logit":
            logits.append(i)
        else:
            cells.setdefault((row(graph, node), node.position), []).append(i)
    widths = [float(MIN_COLUMN)] * seq
    for (_, position), members in cells.items():
        widths[position] = max(widths[position], SPACING * len(members) + 14)
    spare = max(MIN_WIDTH, LOGIT * len(logits)) - LEFT - RIGHT - sum(widths)
    if spare > 0:  # spread the columns over the width
        widths = [w + spare * w / sum(widths) for w in widths]
    starts = [LEFT + sum(widths[:p]) for p in range(seq)]
    step = sum(widths) / max(len(logits), 1)
    top = TOP + 40 * (step < 90)  # room for slanted labels
    ys = [top + (n_rows - 1 - r) * height + height / 2 for r in range(n_rows)]
    points = [(0.0, 0.0)] * len(graph.nodes)
    for (r, position), members in cells.items():
        x = starts[position] + (widths[position] - SPACING * len(members)) / 2
        for k, i in enumerate(members):
            points[i] = (round(x + SPACING * (k + 0.5), 1), ys[r])
    for k, i in enumerate(logits):
        points[i] = (round(LEFT + step * (k + 0.5), 1), ys[-1])
    centres = [starts[p] + widths[p] / 2 for p in range(seq)]
    return Layout(points, centres, ys, LEFT + sum(widths) + RIGHT, ys[0] + BOTTOM, step < 90)

def edges(graph) -> tuple[list[tuple[int, int, float, float]], float]:
    """The kept edges, weakest first (so the strong are drawn on top): ``(source, target, weight, share)``
    with ``share = |weight| / largest``; and the largest ``|weight|``."""
    targets, sources = graph.edge_mask.nonzero(as_tuple=True)
    weights = graph.adjacency[targets, sources]
    largest = float(weights.abs().max()) if len(weights) else 1.0
    return [(int(sources[k]), int(targets[k]), float(weights[k]), abs(float(weights[k])) / largest if largest else 0.0)
            for k in weights.abs().argsort().tolist()], largest


def bend(start: tuple[float, float], end: tuple[float, float]) -> tuple[float, float]:
    """The control point of an edge's quadratic curve (viewer.js bends a supernode's edges the same way)."""
    (x1, y1), (x2, y2) = start, end
    return (x1 + x2) / 2 + (y1 - y2) * 0.08, (y1 + y2) / 2
