"""The attribution-graph viewer: one self-contained HTML page (inline SVG, CSS and JS; no URL fetched), what
``AttributionGraph.plot()`` and ``.show()`` return as a ``qgraph.Figure``.

What a reader of circuit-tracer's and Neuronpedia's viewers uses: the prompt's tokens along the bottom,
the layers up the side, the logits on top labelled with their token and probability, features filled
by their influence on the logits; hovering a node shows its activation and its strongest input and
output edges with their weights; a click pins a node and shows only it and its neighbours; shift-click
selects features that a name groups into a supernode (one node, its edges the sums of its members');
a slider hides the edges under a |weight|; a search box finds nodes by layer, feature or label.

The SVG carries the graph: each node a ``g.qg-node`` (``data-id`` circuit-tracer's node id, ``data-kind``,
``data-layer``, ``data-feature``, ``data-pos``, ``data-activation``...), each edge a ``path.qg-edge``
(``data-source``, ``data-target``, ``data-weight`` the adjacency entry, in full), so a test or a script
reads the numbers off the page. Every string from the graph (tokens, labels) is HTML-escaped; the
script (``viewer.js``) writes text with ``textContent`` only. The same SVG saves as ``.svg``; the PNG
is drawn by matplotlib from the same layout (``picture.py``).
"""
from __future__ import annotations

import html
import sys
import tempfile
import uuid
import webbrowser
from pathlib import Path

from ..figure import Figure
from .layout import (FILLS, NEGATIVE, POSITIVE, STRONG, WEAK, Layout, bend, cut, describe, edges, influence_colour,
                     layout, logit_name, probability, row_name, short_label, token, visible)
from .picture import png

__all__ = ["figure", "show"]

_HERE = Path(__file__).parent
FONT = "Helvetica, Arial, sans-serif"
# a saved .svg's style: the page's drawing rules (viewer.css), without the page
STANDALONE_CSS = ("text { font-family: " + FONT + "; font-size: 11px; fill: #333; } .qg-edge { fill: none; } "
                  ".qg-glyph { stroke: #555; stroke-width: 0.8; } .qg-label { display: none; } "
                  ".qg-grid line { stroke: #eee; } .qg-axis { fill: #888; } "
                  ".qg-caption-title { font-size: 15px; font-weight: bold; }")


def _attributes(**values) -> str:
    return "".join(f' {name.replace("_", "-")}="{html.escape(str(value))}"' for name, value in values.items()
                   if value is not None)


def _glyph(kind: str, x: float, y: float, fill: str) -> str:
    if kind == "feature":
        return f'<circle class="qg-glyph" cx="{x}" cy="{y}" r="6" fill="{fill}"/>'
    w, h, corner = {"error": (10, 10, 0), "embedding": (14, 10, 2), "logit": (14, 10, 2)}[kind]
    return (f'<rect class="qg-glyph" x="{x - w / 2:.1f}" y="{y - h / 2:.1f}" width="{w}" height="{h}" '
            f'rx="{corner}" fill="{fill}"/>')


def _node(graph, i: int, place: Layout, labels, top_logits) -> str:
    node, (x, y) = graph.nodes[i], place.points[i]
    info = describe(graph, i, labels, top_logits)
    label = short_label(graph, i, labels)
    p = probability(graph, i) if node.kind == "logit" else None
    data = _attributes(data_id=node.node_id, data_kind=node.kind, data_layer=node.layer, data_feature=node.feature,
                       data_pos=node.position, data_x=x, data_y=y, data_label=label, data_info=info,
                       data_activation=node.activation, data_influence=node.influence, data_probability=p)
    parts = [f'<g class="qg-node qg-{node.kind}"{data}>', _glyph(node.kind, x, y, influence_colour(node))]
    if node.kind == "logit":  # always labelled: its token and probability, slanted above it
        text = f"{logit_name(graph, i)} {p:.2f}"
        place_text = (f'transform="translate({x + 3},{y - 9}) rotate(-45)"' if place.slanted
                      else f'x="{x}" y="{y - 10}" text-anchor="middle"')
        parts.append(f'<text class="qg-logit-label" {place_text}>{html.escape(text)}</text>')
    elif node.kind != "embedding":  # a label shown when pinned, slanted up (to the left at the right edge)
        text = cut(label, 28)
        left = x + 3 * len(text) > place.width
        side = (f'x="{x - 6}" y="{y - 6}" text-anchor="end" transform="rotate(60 {x - 6} {y - 6})"' if left
                else f'x="{x + 6}" y="{y - 6}" transform="rotate(-60 {x + 6} {y - 6})"')
        parts.append(f'<text class="qg-label" {side}>{html.escape(text)}</text>')
    parts.append(f"<title>{html.escape(info)}</title></g>")
    return "".join(parts)


def _edges(graph, place: Layout) -> tuple[list[str], float]:
    drawn, largest = edges(graph)
    out = []
    for s, t, w, share in drawn:
        (x1, y1), (x2, y2), (cx, cy) = place.points[s], place.points[t], bend(place.points[s], place.points[t])
        source, target = html.escape(graph.nodes[s].node_id), html.escape(graph.nodes[t].node_id)
        out.append(f'<path class="qg-edge" data-source="{source}" data-target="{target}" data-weight="{w!r}" '
                   f'd="M{x1:.1f},{y1:.1f} Q{cx:.1f},{cy:.1f} {x2:.1f},{y2:.1f}" '
                   f'stroke="{POSITIVE if w >= 0 else NEGATIVE}" stroke-width="{0.5 + 3.5 * share:.2f}" '
                   f'stroke-opacity="{0.25 + 0.65 * share:.2f}"><title>{source} → {target}: {w:.4g}</title></path>')
    return out, largest


def _legend(key: str) -> str:
    """The key to the picture, one line across the top."""
    stops = "".join(f'<stop offset="{o}" stop-color="rgb{c}"/>' for o, c in ((0, WEAK), (1, STRONG)))
    items = [f'<defs><linearGradient id="{key}-influence">{stops}</linearGradient></defs>',
             f'<circle cx="6" cy="0" r="6" fill="{FILLS["feature"]}" class="qg-glyph"/>'
             f'<text x="16" y="4">feature, filled by influence on the logits:</text>'
             f'<text x="266" y="4" text-anchor="end">low</text>'
             f'<rect x="270" y="-5" width="60" height="10" fill="url(#{key}-influence)" class="qg-glyph"/>'
             f'<text x="334" y="4">high</text>',
             f'<rect x="376" y="-5" width="10" height="10" fill="{FILLS["error"]}" class="qg-glyph"/>'
             f'<text x="392" y="4">error</text>',
             f'<rect x="436" y="-5" width="14" height="10" rx="2" fill="{FILLS["embedding"]}" class="qg-glyph"/>'
             f'<text x="456" y="4">token</text>',
             f'<rect x="502" y="-5" width="14" height="10" rx="2" fill="{FILLS["logit"]}" class="qg-glyph"/>'
             f'<text x="522" y="4">logit (token, probability)</text>',
             f'<path d="M676,0 h24" stroke="{POSITIVE}" stroke-width="3"/><text x="706" y="4">positive</text>',
             f'<path d="M764,0 h24" stroke="{NEGATIVE}" stroke-width="3"/><text x="794" y="4">negative edge, '
             f'width by |weight|</text>']
    return f'<g class="qg-legend" transform="translate(12,40)">{"".join(items)}</g>'


def _title(graph) -> tuple[str, str]:
    prompt = graph.prompt if graph.prompt is not None else "".join(graph.tokens or [])
    title = f"Attribution graph · “{cut(prompt, 120)}”" if prompt else "Attribution graph"
    parts = [str(graph.scan)] if isinstance(graph.scan, str) else []
    parts += [f"{graph.count('feature')} features", f"{graph.count('error')} errors",
              f"{len(graph.input_ids)} tokens", f"{graph.count('logit')} logits", f"{int(graph.edge_mask.sum())} edges"]
    if graph.pruned is not None:
        parts.append("pruned at " + ", ".join(f"{name} {value}" for name, value in zip(("nodes", "edges"), graph.pruned)
                                              if value is not None))
    return title, " · ".join(parts)


def svg(graph, labels, top_logits, key: str, place: Layout) -> str:
    """The graph as an SVG element (its title and legend inside it)."""
    title, subtitle = _title(graph)
    paths, largest = _edges(graph, place)
    out = [f'<svg class="qg-graph" width="{place.width:.0f}" height="{place.height:.0f}" viewBox="0 0 '
           f'{place.width:.0f} {place.height:.0f}" data-largest="{largest!r}" role="img" '
           f'aria-label="{html.escape(title)}">',
           f'<g class="qg-caption"><text x="12" y="16" class="qg-caption-title">{html.escape(title)}</text>'
           f'<text x="12" y="30">{html.escape(subtitle)}</text></g>', _legend(key), '<g class="qg-grid">']
    for r, y in enumerate(place.rows):
        out.append(f'<line x1="50" y1="{y}" x2="{place.width - 8:.0f}" y2="{y}"/>'
                   f'<text class="qg-axis" x="44" y="{y + 4}" text-anchor="end">{row_name(graph, r)}</text>')
    for position, x in enumerate(place.centres):
        text = token(graph, position)
        out.append(f'<text class="qg-token" x="{x:.1f}" y="{place.rows[0] + 26:.0f}" text-anchor="middle" '
                   f'data-pos="{position}">{html.escape(visible(text, 10))}<title>{position}: '
                   f'{html.escape(visible(text))}</title></text>')
    out += ['</g><g class="qg-edges">', *paths, '</g><g class="qg-nodes">']
    out += [_node(graph, i, place, labels, top_logits) for i in range(len(graph.nodes))]
    out.append("</g></svg>")
    return "".join(out)


def _panel() -> str:
    return ('<aside class="qg-panel">'
            '<div class="qg-box"><label>prune edges: |weight| ≥ <b class="qg-threshold-value">0</b>'
            '<input type="range" class="qg-threshold" min="0" max="1000" step="1" value="0" data-threshold="0">'
            '</label><div class="qg-count"></div></div>'
            '<div class="qg-box"><input type="search" class="qg-search" placeholder="search: L2, F5, L2 F5, '
            'a label or a token"><div class="qg-found"></div></div>'
            '<div class="qg-box"><div class="qg-selected">shift-click features to select them</div>'
            '<input class="qg-group-name" placeholder="supernode name"> <button type="button" class="qg-group">'
            'group</button><ul class="qg-supernodes"></ul></div>'
            '<div class="qg-detail"></div></aside>')


def figure(graph, labels, top_logits) -> Figure:
    """The viewer of ``graph`` (drawn as it is: prune it first) as a ``qgraph.Figure``."""
    key = f"qg-{uuid.uuid4().hex[:10]}"
    labels = {**graph.labels, **labels}
    place = layout(graph)
    drawn = svg(graph, labels, top_logits, key, place)
    title, subtitle = _title(graph)
    css = (_HERE / "viewer.css").read_text(encoding="utf-8")
    script = (_HERE / "viewer.js").read_text(encoding="utf-8").replace("__KEY__", key)
    help_line = ("hover a node: its activation and strongest edges · click: only it and its neighbours (click "
                 "again or Esc: all) · shift-click features, then “group”: a supernode · the slider hides weak edges")
    page = (f'<div class="qg-viewer" id="{key}"><style>{css}</style>'
            f'<div class="qg-head"><div class="qg-title">{html.escape(title)}</div>'
            f'<div class="qg-sub">{html.escape(subtitle)}</div><div class="qg-help">{help_line}</div></div>'
            f'<div class="qg-body"><div class="qg-canvas"><div style="min-width:{0.7 * place.width:.0f}px">'
            f'{drawn}</div></div>{_panel()}</div><script>{script}</script></div>')
    standalone = drawn.replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1)
    standalone = standalone.replace(">", f"><style>{STANDALONE_CSS}</style>", 1)
    return Figure(standalone, html=page, png=lambda: png(graph, place, title, subtitle), title=title)


def show(fig: Figure) -> Figure:
    """``fig`` shown: displayed in a notebook's cell, else saved to a temporary file the browser opens."""
    shell = sys.modules.get("IPython")  # loaded already where a kernel runs; never imported here
    if shell is not None and getattr(shell.get_ipython(), "kernel", None) is not None:
        from IPython.display import display  # lazy: IPython, only where a notebook's kernel has loaded it

        display(fig)
        return fig
    path = Path(tempfile.mkdtemp(prefix="qgraph-")) / "attribution-graph.html"
    fig.save(path)
    print(f"attribution graph: {path}")
    webbrowser.open(path.as_uri())
    return fig
