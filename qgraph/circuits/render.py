"""Views of a (pruned) ``AttributionGraph``: a self-contained HTML figure and a ``graphviz.Digraph``.

The figure is inline SVG with its CSS and a few lines of JS: no script, style sheet or font is fetched,
so it works offline and in a notebook. Rows are the layers (the embeddings at the bottom, the logits on
top), columns the token positions; the nodes of one (layer, position) share their cell. Edges are blue
when positive and red when negative, wider and darker with their magnitude; hovering a node shows what
it is and lights up its edges.
"""
from __future__ import annotations

import html
import uuid

from ..figure import Figure

__all__ = ["Figure", "digraph", "figure"]

POSITIVE, NEGATIVE = "#2166ac", "#b2182b"
FILLS = {"feature": "#f6c25b", "error": "#bdbdbd", "embedding": "#9ecae1", "logit": "#a1d99b"}
ROW, SPACING, MIN_COLUMN, LEFT, TOP, BOTTOM = 44, 18, 84, 64, 24, 40
FONT = "Helvetica, Arial, sans-serif"

_CSS = """#{key} {{ font-family: {font}; font-size: 11px; background: #fff; }}
#{key} .qg-edge {{ fill: none; }}
#{key} .qg-node {{ cursor: default; }}
#{key} .qg-node > :first-child {{ stroke: #555; stroke-width: 0.8; }}
#{key}.qg-focus .qg-edge {{ opacity: 0.06; }}
#{key}.qg-focus .qg-edge.qg-on {{ opacity: 1; }}
#{key} .qg-node.qg-on > :first-child {{ stroke: #000; stroke-width: 2; }}
#{key} .qg-axis {{ fill: #666; }}
#{key} .qg-grid {{ stroke: #eee; }}
#{key}-info {{ font-family: {font}; font-size: 12px; white-space: pre-line; min-height: 3.2em; color: #333;
  padding: 4px 8px; border-left: 3px solid #ddd; }}"""

_SCRIPT = """(function () {{
  var root = document.getElementById("{key}"), info = document.getElementById("{key}-info");
  if (!root) return;
  var edges = root.querySelectorAll(".qg-edge");
  root.querySelectorAll(".qg-node").forEach(function (node) {{
    var i = node.getAttribute("data-i");
    node.addEventListener("mouseenter", function () {{
      root.classList.add("qg-focus"); node.classList.add("qg-on");
      edges.forEach(function (e) {{
        if (e.getAttribute("data-s") === i || e.getAttribute("data-t") === i) e.classList.add("qg-on");
      }});
      if (info) info.textContent = node.getAttribute("data-info");
    }});
    node.addEventListener("mouseleave", function () {{
      root.classList.remove("qg-focus");
      root.querySelectorAll(".qg-on").forEach(function (e) {{ e.classList.remove("qg-on"); }});
    }});
  }});
}})();"""


def _figure(svg: str, key: str, title: str) -> Figure:
    """A ``qgraph.Figure`` of the graph's SVG: the page has the hover panel, the ``.svg`` its tooltips."""
    css = _CSS.format(key=key, font=FONT)
    page = (f'<div class="qg-figure"><style>{css}</style>{svg}'
            f'<div id="{key}-info">Hover a node.</div><script>{_SCRIPT.format(key=key)}</script></div>')
    # a standalone SVG names its namespace and carries its style
    standalone = svg.replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1)
    standalone = standalone.replace(">", f"><style>{html.escape(css, quote=False)}</style>", 1)
    return Figure(standalone, html=page, title=title)


def _row(graph, node) -> int:
    """The row a node is drawn in: 0 for embeddings, 1 + layer for features and errors, the top for logits."""
    if node.kind == "embedding":
        return 0
    if node.kind == "logit":
        return graph.n_layers + 1
    return node.layer + 1


def _token(graph, position: int) -> str:
    return graph.tokens[position] if graph.tokens is not None else str(int(graph.input_ids[position]))


def _describe(graph, i: int, labels, top_logits) -> str:
    """What hovering node ``i`` shows, one fact a line."""
    node = graph.nodes[i]
    where = f"position {node.position} ({_token(graph, node.position)!r})"
    if node.kind == "feature":
        lines = [f"feature {node.feature} · layer {node.layer} · {where}"]
        if node.activation is not None:
            lines.append(f"activation {node.activation:.4g}")
        if (node.layer, node.feature) in labels:
            lines.append(f"label: {labels[node.layer, node.feature]}")
        if (node.layer, node.feature) in top_logits:
            lines.append("top logits: " + ", ".join(map(repr, top_logits[node.layer, node.feature])))
    elif node.kind == "error":
        lines = [f"error · layer {node.layer} · {where}"]
    elif node.kind == "embedding":
        lines = [f"embedding of token {node.feature} · {where}"]
    else:
        j = i - (len(graph.nodes) - graph.count("logit"))
        token = graph.logit_tokens[j] if graph.logit_tokens is not None else str(node.feature)
        lines = [f"logit {token!r} (token {node.feature}) · p = {float(graph.logit_probabilities[j]):.3f}"]
    lines.append(f"input {float(graph.node_inputs[i]):.4g}")
    if node.influence is not None:
        lines.append(f"cumulative influence {node.influence:.3f}")
    lines.append(f"id {node.node_id}")
    return "\n".join(lines)


def _layout(graph) -> tuple[list[tuple[float, float]], list[float], int, int]:
    """Each node's (x, y), each position's column centre, the width and the height."""
    seq, rows = len(graph.input_ids), graph.n_layers + 2
    cells: dict[tuple[int, int], list[int]] = {}
    for i, node in enumerate(graph.nodes):
        cells.setdefault((_row(graph, node), node.position), []).append(i)
    widths = [MIN_COLUMN] * seq
    for (_, position), members in cells.items():
        widths[position] = max(widths[position], SPACING * (len(members) + 1))
    starts = [LEFT + sum(widths[:p]) for p in range(seq)]
    points = [(0.0, 0.0)] * len(graph.nodes)
    for (row, position), members in cells.items():
        y = TOP + (rows - 1 - row) * ROW + ROW / 2
        for k, i in enumerate(members):
            points[i] = (starts[position] + widths[position] * (k + 1) / (len(members) + 1), y)
    centres = [starts[p] + widths[p] / 2 for p in range(seq)]
    return points, centres, LEFT + sum(widths) + 8, TOP + rows * ROW + BOTTOM


def _glyph(kind: str, x: float, y: float) -> str:
    fill = FILLS[kind]
    if kind == "feature":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="6" fill="{fill}"/>'
    w, h, corner = {"error": (10, 10, 0), "embedding": (16, 10, 2), "logit": (16, 10, 2)}[kind]
    return f'<rect x="{x - w / 2:.1f}" y="{y - h / 2:.1f}" width="{w}" height="{h}" rx="{corner}" fill="{fill}"/>'


def figure(graph, labels, top_logits) -> Figure:
    """The HTML figure of ``graph`` (drawn as it is: prune it first)."""
    key = f"qg-{uuid.uuid4().hex[:10]}"
    points, centres, width, height = _layout(graph)
    out = [f'<svg id="{key}" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">']
    for row in range(graph.n_layers + 2):
        y = TOP + (graph.n_layers + 1 - row) * ROW + ROW / 2
        name = "E" if row == 0 else "logits" if row == graph.n_layers + 1 else f"L{row - 1}"
        out.append(f'<line class="qg-grid" x1="{LEFT - 6}" y1="{y:.1f}" x2="{width - 4}" y2="{y:.1f}"/>'
                   f'<text class="qg-axis" x="{LEFT - 10}" y="{y + 4:.1f}" text-anchor="end">{name}</text>')
    for position, x in enumerate(centres):
        token = _token(graph, position)
        token = token if len(token) <= 12 else token[:11] + "…"
        out.append(f'<text class="qg-axis" x="{x:.1f}" y="{height - BOTTOM + 16}" text-anchor="middle">'
                   f'{html.escape(repr(token)[1:-1])}</text>')

    targets, sources = graph.edge_mask.nonzero(as_tuple=True)
    weights = graph.adjacency[targets, sources]
    largest = float(weights.abs().max()) if len(weights) else 1.0
    for k in weights.abs().argsort().tolist():  # the strongest edges drawn last, on top
        t, s, w = int(targets[k]), int(sources[k]), float(weights[k])
        (x1, y1), (x2, y2) = points[s], points[t]
        share = abs(w) / largest if largest else 0.0
        out.append(f'<path class="qg-edge" data-s="{s}" data-t="{t}" d="M{x1:.1f},{y1:.1f} '
                   f'Q{(x1 + x2) / 2 + (y1 - y2) * 0.08:.1f},{(y1 + y2) / 2:.1f} {x2:.1f},{y2:.1f}" '
                   f'stroke="{POSITIVE if w >= 0 else NEGATIVE}" stroke-width="{0.4 + 3.6 * share:.2f}" '
                   f'stroke-opacity="{0.2 + 0.7 * share:.2f}"><title>{graph.nodes[s].node_id} → '
                   f'{graph.nodes[t].node_id}: {w:.4g}</title></path>')
    for i, node in enumerate(graph.nodes):
        info = html.escape(_describe(graph, i, labels, top_logits))
        out.append(f'<g class="qg-node qg-{node.kind}" data-i="{i}" data-info="{info}">'
                   f'{_glyph(node.kind, *points[i])}<title>{info}</title></g>')
    out.append("</svg>")
    return _figure("".join(out), key, repr(graph))


def digraph(graph, labels):
    """The graph as a ``graphviz.Digraph``: node ``n{i}`` for node ``i``, one rank per row (embeddings at
    the bottom, logits on top, kept in order by invisible anchors), edges coloured and sized by weight."""
    from ..render.engine import Digraph  # the system's dot, else pygraphviz's bundled Graphviz

    g = Digraph("attribution_graph")
    g.attr(rankdir="BT", newrank="true", ranksep="0.45", nodesep="0.18", fontname="Helvetica")
    g.attr("node", fontname="Helvetica", fontsize="9", style="filled", margin="0.05,0.02", height="0.25")
    g.attr("edge", arrowsize="0.5")
    rows: dict[int, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        rows.setdefault(_row(graph, node), []).append(i)
    shapes = {"feature": "ellipse", "error": "box", "embedding": "box", "logit": "box"}
    for row in range(graph.n_layers + 2):
        with g.subgraph(name=f"rank_{row}") as rank:
            rank.attr(rank="same")
            name = "E" if row == 0 else "logits" if row == graph.n_layers + 1 else f"L{row - 1}"
            rank.node(f"row_{row}", name, shape="plaintext", style="", fontcolor="#666666")
            for i in rows.get(row, []):
                node = graph.nodes[i]
                if node.kind == "feature":
                    text = f"{node.feature}@{node.position}"
                    if (node.layer, node.feature) in labels:
                        text = f"{labels[node.layer, node.feature]}\n{text}"
                elif node.kind == "error":
                    text = f"err@{node.position}"
                elif node.kind == "embedding":
                    text = _token(graph, node.position)
                else:
                    j = i - (len(graph.nodes) - graph.count("logit"))
                    token = graph.logit_tokens[j] if graph.logit_tokens is not None else str(node.feature)
                    text = f"{token} ({float(graph.logit_probabilities[j]):.2f})"
                rank.node(f"n{i}", text, shape=shapes[node.kind], fillcolor=FILLS[node.kind],
                          tooltip=_describe(graph, i, labels, {}))
    for row in range(graph.n_layers + 1):
        g.edge(f"row_{row}", f"row_{row + 1}", style="invis")
    targets, sources = graph.edge_mask.nonzero(as_tuple=True)
    weights = graph.adjacency[targets, sources]
    largest = float(weights.abs().max()) if len(weights) else 1.0
    for t, s, w in zip(targets.tolist(), sources.tolist(), weights.tolist()):
        share = abs(w) / largest if largest else 0.0
        g.edge(f"n{s}", f"n{t}", color=POSITIVE if w >= 0 else NEGATIVE, penwidth=f"{0.4 + 3.6 * share:.2f}",
               tooltip=f"{w:.4g}")
    return g
