"""A ``Diagram`` (``diagram.py``) as Graphviz DOT, and as svg, png or pdf: both through the ``graphviz``
package (its ``pipe()`` runs Graphviz's ``dot`` program; ``graphviz.ExecutableNotFound`` when it is missing)."""
from __future__ import annotations

from pathlib import Path

import graphviz

from .engine import Digraph

from ..errors import InvalidArgument, InvalidState, QgraphError

FONT = "Helvetica"
FORMATS = ("svg", "png", "pdf", "dot")

# Standard values, instrumented values and edit slots: three fills no other box uses.
TAP_FILL = "#FFF4CC"
VALUE_FILL = "#FFB25B"
EDIT_FILL = "#D81B60"

BOX_STYLES = {
    "module": dict(shape="box", style="rounded,filled", fillcolor="#DCEAFE", color="#4A7BD0", penwidth="1.2"),
    "norm": dict(shape="box", style="rounded,filled", fillcolor="#DDF3E4", color="#3E9B5C", penwidth="1.2"),
    "act": dict(shape="box", style="rounded,filled", fillcolor="#E9F7D8", color="#6A9F2A", penwidth="1.2"),
    "op": dict(shape="box", style="rounded,filled", fillcolor="#F2F2F2", color="#8C8C8C", fontsize="10"),
    "op_hidden": dict(shape="box", style="rounded,filled,dashed", fillcolor="#FAFAFA", color="#BBBBBB",
                      fontsize="8", fontcolor="#888888"),
    "split": dict(shape="box", style="rounded,filled", fillcolor="#F2F2F2", color="#8C8C8C", fontsize="10"),
    "rotary": dict(shape="box", style="rounded,filled", fillcolor="#F7E3FB", color="#A24DB8"),
    "core": dict(shape="box", style="rounded,filled,bold", fillcolor="#E6DCFF", color="#6A42C2", penwidth="2",
                 fontsize="12", margin="0.25,0.1"),
    "sum": dict(shape="circle", style="filled", fillcolor="#FFFFFF", color="#333333", fontsize="18", width="0.38",
                fixedsize="true", penwidth="1.6"),
    "product": dict(shape="circle", style="filled", fillcolor="#FFFFFF", color="#555555", fontsize="16",
                    width="0.34", fixedsize="true"),
    "stream": dict(shape="box", style="rounded,filled", fillcolor="#3B3B3B", color="#3B3B3B", fontcolor="#FFFFFF",
                   fontsize="11"),
    "context": dict(shape="note", style="filled", fillcolor="#F6F6F6", color="#A0A0A0", fontsize="9",
                    fontcolor="#555555"),
    "param": dict(shape="box", style="rounded,dashed", color="#BBBBBB", fontsize="8", height="0.2", margin="0.04,0.02"),
    "io": dict(shape="box", style="rounded,filled", fillcolor="#3B3B3B", color="#3B3B3B", fontcolor="#FFFFFF"),
    "block_delta": dict(shape="box", style="rounded,filled", fillcolor="#DCEAFE", color="#4A7BD0", penwidth="1.4",
                        width="2.6"),
    "block_attn": dict(shape="box", style="rounded,filled", fillcolor="#E6DCFF", color="#6A42C2", penwidth="1.4",
                       width="2.6"),
    "block_vision": dict(shape="box", style="rounded,filled", fillcolor="#FCE4EC", color="#C2185B", penwidth="1.2",
                         width="2.2"),
    "io_side": dict(shape="box", style="rounded,filled", fillcolor="#6B6B6B", color="#6B6B6B", fontcolor="#FFFFFF",
                    fontsize="9", height="0.22"),
    "glue": dict(shape="box", style="rounded,filled", fillcolor="#F2F2F2", color="#8C8C8C", fontsize="10"),
    "tap": dict(shape="box", style="rounded,filled", fillcolor=TAP_FILL, color="#D9B23A", fontsize="10",
                height="0.22", margin="0.08,0.03", penwidth="1"),
    "tap_value": dict(shape="box", style="rounded,filled,bold", fillcolor=VALUE_FILL, color="#B85C00", fontsize="10",
                      height="0.22", margin="0.08,0.03", penwidth="2"),
    "tap_edit": dict(shape="box", style="rounded,filled,bold", fillcolor=EDIT_FILL, color="#7A0033", fontsize="10",
                     height="0.22", margin="0.08,0.03", penwidth="2"),
    "tap_ghost": dict(shape="box", style="rounded,dashed", color="#AAAAAA", fontsize="10", height="0.22",
                      margin="0.08,0.03", fontcolor="#777777"),
}
WIRE_STYLES = {
    "data": dict(color="#555555", arrowsize="0.6", penwidth="1.1"),
    "spine": dict(color="#2B2B2B", arrowsize="0.7", penwidth="3.2", weight="30"),
    "context": dict(color="#A8A8A8", style="dashed", arrowsize="0.5", penwidth="0.9"),
    "ghost": dict(color="#AAAAAA", style="dotted", arrowhead="none", penwidth="1.1"),
    "block": dict(color="#2B2B2B", arrowsize="0.7", penwidth="2.6", weight="30"),
}
BUNDLE = dict(penwidth="1.5", arrowsize="0.9", fontsize="9", fontcolor="#2B2B2B")  # several streams' wire
BUNDLE_GAP = "#FFFFFF"  # between a bundle's lines
CLUSTER_STYLES = {
    "block": dict(style="rounded,filled", fillcolor="#FBFBFB", color="#9A9A9A", penwidth="1.4", fontsize="13"),
    "mixer_attention": dict(style="rounded,filled", fillcolor="#F4F0FF", color="#9C86D9", fontsize="12"),
    "mixer_recurrent": dict(style="rounded,filled", fillcolor="#EEF5FF", color="#7FA2DD", fontsize="12"),
    "mlp": dict(style="rounded,filled", fillcolor="#FFF6EB", color="#E0A860", fontsize="12"),
    "scope": dict(style="rounded", color="#C8C8C8", fontsize="9", fontcolor="#666666"),
    "vision": dict(style="rounded,filled", fillcolor="#FFF3F7", color="#D98AA8", fontsize="12"),
    "legend": dict(style="rounded", color="#DDDDDD", fontsize="10", fontcolor="#666666"),
}


class GraphvizNotFound(QgraphError, graphviz.ExecutableNotFound):
    """The ``dot`` program is not installed; the DOT source was written instead (a ``RuntimeError``)."""

    def __init__(self, message: str) -> None:
        RuntimeError.__init__(self, message)


def to_graphviz(diagram) -> graphviz.Digraph:
    """The ``Diagram`` as a ``graphviz.Digraph`` (its ``.source`` is the DOT text)."""
    g = Digraph("qgraph")
    g.attr(rankdir="TB", fontname=FONT, bgcolor="white", nodesep="0.28", ranksep="0.32", newrank="true",
           pad="0.3", ordering="out", labelloc="t", labeljust="l", fontsize="15",
           label=f'<<B>{_escape(diagram.title)}</B>>', tooltip=diagram.title)
    g.attr("node", fontname=FONT, fontsize="11", shape="box", style="rounded,filled", margin="0.14,0.06",
           height="0.3")
    g.attr("edge", fontname=FONT, fontsize="8", fontcolor="#6A42C2")

    members: dict[str | None, list] = {}
    for box in diagram.boxes.values():
        members.setdefault(box.cluster if box.cluster in diagram.clusters else None, []).append(box)
    children: dict[str | None, list[str]] = {}
    for key, cluster in diagram.clusters.items():
        parent = cluster.parent if cluster.parent in diagram.clusters else None
        children.setdefault(parent, []).append(key)

    def fill(graph, key):
        for box in members.get(key, ()):
            attrs = dict(BOX_STYLES.get(box.kind, {}))
            attrs.update({k: str(v) for k, v in box.attrs.items() if k in ("group", "id", "width", "height")})
            if box.tooltip:
                attrs["tooltip"] = box.tooltip
            graph.node(box.id, f"<{box.label}>", **attrs)
        for child in children.get(key, ()):
            cluster = diagram.clusters[child]
            with graph.subgraph(name=f"cluster_{len(cluster_ids)}") as sub:
                cluster_ids.append(child)
                sub.attr(label=f"<<B>{_escape(cluster.label)}</B>>", labeljust="l", fontname=FONT,
                         margin="10", tooltip=child, **CLUSTER_STYLES.get(cluster.kind, CLUSTER_STYLES["scope"]))
                fill(sub, child)

    cluster_ids: list[str] = []
    fill(g, None)
    for row in diagram.same_rank:
        with g.subgraph() as same:
            same.attr(rank="same")
            for box_id in row:
                same.node(box_id)
            for left, right in zip(row, row[1:]):  # a flat edge keeps them in this order, left to right
                same.edge(left, right, style="invis")
    for wire in sorted(diagram.wires, key=lambda w: w.kind not in ("spine", "block")):
        attrs = dict(WIRE_STYLES.get(wire.kind, WIRE_STYLES["data"]))
        if wire.streams > 1:  # a bundle: that many parallel lines (Graphviz draws a colour list side by side)
            attrs.update(BUNDLE, color=":".join([attrs["color"]] + [BUNDLE_GAP, attrs["color"]] * (wire.streams - 1)))
        attrs.update({k: str(v) for k, v in wire.attrs.items()})
        if wire.label:
            attrs["xlabel"] = wire.label
        g.edge(wire.src, wire.dst, **attrs)
    if diagram.legend:
        rows = []
        for kind, text in diagram.legend:
            style = BOX_STYLES.get(kind, {})
            background = style.get("fillcolor", "#FFFFFF") if "filled" in style.get("style", "") else "#FFFFFF"
            border = style.get("color", "#999999")
            dashed = ' STYLE="dashed"' if "dashed" in style.get("style", "") else ""
            rows.append(f'<TR><TD BGCOLOR="{background}" COLOR="{border}" BORDER="1"{dashed} '
                        f'WIDTH="26" HEIGHT="12"></TD>'
                        f'<TD ALIGN="LEFT"><FONT POINT-SIZE="9" COLOR="#444444">{_escape(text)}</FONT></TD></TR>')
        g.node("legend", '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="4" CELLPADDING="2">'
               + "".join(rows) + "</TABLE>>", shape="box", style="rounded", color="#DDDDDD", margin="0.05")
    return g


def _escape(text: str) -> str:
    import html
    return html.escape(text, quote=False)


def write(diagram, path: str | Path, *, dpi: int = 110) -> Path:
    """Write the ``Diagram`` to ``path``, in the format its extension names (svg, png, pdf or dot)."""
    path = Path(path)
    fmt = path.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise InvalidArgument(f"cannot render to '{path.name}': the extension picks the format, one of "
                              f"{', '.join('.' + f for f in FORMATS)}")
    graph = to_graphviz(diagram)
    source = graph.source
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "dot":
        path.write_text(source)
        return path
    if fmt == "png":
        graph.attr(dpi=str(dpi))
    try:
        drawn = graph.pipe(format=fmt, quiet=True)
    except graphviz.ExecutableNotFound as missing:
        dot_path = path.with_suffix(".dot")
        dot_path.write_text(source)
        raise GraphvizNotFound(
            f"neither Graphviz's 'dot' program nor pygraphviz (which bundles Graphviz) is installed, so qgraph "
            f"cannot make '{path.name}'. It wrote the DOT source to {dot_path}. `pip install pygraphviz` (a wheel "
            f"for Linux, macOS arm64 and Windows), or install Graphviz (Debian/Ubuntu: `apt-get install "
            f"graphviz`; macOS: `brew install graphviz`), then render again.") from missing
    except graphviz.CalledProcessError as failed:
        stderr = failed.stderr.decode(errors="replace") if isinstance(failed.stderr, bytes) else str(failed.stderr)
        raise InvalidState(f"dot failed to render {path}: {stderr.strip()}") from failed
    path.write_bytes(drawn)
    return path


def svg(diagram) -> str | None:
    """The ``Diagram`` as svg text, or None when Graphviz's ``dot`` is not installed."""
    try:
        return to_graphviz(diagram).pipe(format="svg", encoding="utf-8", quiet=True)
    except graphviz.ExecutableNotFound:
        return None
