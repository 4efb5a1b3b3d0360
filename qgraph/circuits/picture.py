"""The attribution-graph viewer's picture as a PNG: the page's drawing (``viewer.py``) redrawn by matplotlib
from the same layout, on its Agg canvas (no GUI, no pyplot state), with the title and legend in it: what
``graph.plot().save("graph.png")`` writes, for a slide or a paper."""
from __future__ import annotations

import io
from typing import Any

from .layout import FILLS, NEGATIVE, POSITIVE, STRONG, WEAK, Layout, bend, edges, influence_colour, logit_name, \
    probability, row_name, token, visible

__all__ = ["png"]

PIXEL = 0.75  # points per pixel of the layout (72 points an inch at 96 pixels)


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#" + "".join(f"{c:02x}" for c in rgb)


MAX_PIXELS = 8000  # the PNG's longer side at most: a long prompt's layout is wide, and 160 dpi of it is tens of MB


def png(graph, place: Layout, title: str, subtitle: str, dpi: int = 160) -> bytes:
    """The picture of ``graph`` laid out as ``place``, ``dpi`` dots per 96 layout pixels' inch (less where the
    longer side would pass ``MAX_PIXELS``)."""
    # lazy: matplotlib (a second or so) only when a PNG is asked for
    from matplotlib.figure import Figure as Canvas
    from matplotlib.lines import Line2D
    from matplotlib.patches import Circle, PathPatch, Rectangle
    from matplotlib.path import Path

    canvas = Canvas(figsize=(place.width / 96, place.height / 96))
    ax = canvas.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, place.width)
    ax.set_ylim(place.height, 0)
    ax.axis("off")
    font: dict[str, Any] = dict(fontfamily="DejaVu Sans", color="#333333")
    ax.text(12, 16, title, fontsize=15 * PIXEL, fontweight="bold", va="baseline", **font)
    ax.text(12, 30, subtitle, fontsize=11 * PIXEL, va="baseline", **font)
    for r, y in enumerate(place.rows):
        ax.plot([50, place.width - 8], [y, y], color="#eeeeee", lw=1 * PIXEL, zorder=0)
        ax.text(44, y + 4, row_name(graph, r), ha="right", fontsize=11 * PIXEL, color="#888888")
    for position, x in enumerate(place.centres):
        ax.text(x, place.rows[0] + 26, visible(token(graph, position), 10), ha="center", fontsize=12 * PIXEL,
                color="#111111")

    drawn, _ = edges(graph)
    for s, t, w, share in drawn:
        start, end = place.points[s], place.points[t]
        curve = Path([start, bend(start, end), end], [Path.MOVETO, Path.CURVE3, Path.CURVE3])
        ax.add_patch(PathPatch(curve, fill=False, edgecolor=POSITIVE if w >= 0 else NEGATIVE,
                               lw=(0.5 + 3.5 * share) * PIXEL, alpha=0.25 + 0.65 * share, zorder=1))
    for i, node in enumerate(graph.nodes):
        x, y = place.points[i]
        style: dict[str, Any] = dict(facecolor=influence_colour(node), edgecolor="#555555", lw=0.8 * PIXEL, zorder=2)
        if node.kind == "feature":
            ax.add_patch(Circle((x, y), 6, **style))
            continue
        w, h = (10, 10) if node.kind == "error" else (14, 10)
        ax.add_patch(Rectangle((x - w / 2, y - h / 2), w, h, **style))
        if node.kind == "logit":
            text = f"{logit_name(graph, i)} {probability(graph, i):.2f}"
            flat: dict[str, Any] = dict(rotation=45, rotation_mode="anchor") if place.slanted else dict(ha="center")
            ax.text(x + 3 * place.slanted, y - 9, text, fontsize=11 * PIXEL, color="#1b5e20", **flat)

    swatch: dict[str, Any] = dict(linestyle="none", markeredgecolor="#555555", markersize=9)
    handles = [Line2D([], [], marker="o", markerfacecolor=FILLS["feature"], **swatch),
               Line2D([], [], marker="o", markerfacecolor=_hex(WEAK), **swatch),
               Line2D([], [], marker="o", markerfacecolor=_hex(STRONG), **swatch),
               Line2D([], [], marker="s", markerfacecolor=FILLS["error"], **swatch),
               Line2D([], [], marker="s", markerfacecolor=FILLS["embedding"], **swatch),
               Line2D([], [], marker="s", markerfacecolor=FILLS["logit"], **swatch),
               Line2D([], [], color=POSITIVE, lw=2.5), Line2D([], [], color=NEGATIVE, lw=2.5)]
    names = ["feature:", "low influence", "high influence", "error", "token", "logit (token, probability)",
             "positive", "negative edge (width: |weight|)"]
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(4 / place.width, 1 - 32 / place.height),
              ncol=len(names), frameon=False, fontsize=11 * PIXEL, handlelength=1.6, columnspacing=1.2,
              handletextpad=0.4, borderaxespad=0)
    buffer = io.BytesIO()
    canvas.savefig(buffer, format="png", dpi=min(dpi, MAX_PIXELS * 96 / max(place.width, place.height)),
                   facecolor="white")
    return buffer.getvalue()
