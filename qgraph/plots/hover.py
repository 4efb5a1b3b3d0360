"""The HTML form of every figure qgraph draws: the figure's own SVG (matplotlib's, the same picture as the
``.svg`` and ``.png``) with a hover layer, so pointing at a cell shows the number qgraph computed there.

One writer for every heatmap-like figure (patterns, effective attention, decays and betas, states,
residual grids, SAE features, the lens, attributions, patching sweeps; line and bar plots too, a
column or a row at a time). A figure names, for each of its grids, the axes it is drawn on and what
each cell says (``Cells``); after matplotlib has laid the figure out, each grid gets one transparent
``<rect class="qg-hit">`` over its cells (the axes' own transform gives its place), and the page
carries each grid's values (3 significant digits, as Python's ``format(v, ".3g")`` writes them) and
labels as JSON. A few lines of inline JavaScript turn the pointer's place in a rect into a cell and
fill the tooltip (``.qg-tip``: the panel, the row, the column, the value) and outline the cell; the
tooltip also carries the cell as ``data-row``, ``data-col`` and ``data-value``. One JSON array per
grid rather than an element per cell keeps the page small (a 128-token pattern of 8 heads is 131k
cells). Nothing is fetched: the page works offline, in a notebook and saved to disk.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InternalError
from ..figure import Figure, inline_svg

__all__ = ["Cells", "hover_figure"]


@dataclass
class Cells:
    """One grid of a figure and what its cells say on hover.

    ``axes``: the matplotlib axes it is drawn on, its cell ``(r, c)`` centred at data ``(c, r)`` (as
    ``imshow`` and ``plot(range(n), ...)`` put them); ``values`` ``[rows, columns]`` (NaN: blank);
    ``rows`` and ``columns`` each row's and column's label in the tooltip ("query 3: c"; "" says
    nothing); ``what`` the value's name; ``panel`` the panel's ("head 2"); ``notes`` a line more per
    cell, ``[rows][columns]`` (the lens's top tokens). ``span``: "cells" (the grid is the image),
    "columns" (each column spans the axes' height: a line or bar plot over tokens), "rows" (each row
    spans its width: horizontal bars)."""

    axes: Any  # a matplotlib Axes
    values: torch.Tensor
    rows: list[str]
    columns: list[str]
    what: str
    panel: str = ""
    notes: list[list[str]] | None = None
    span: str = "cells"


def hover_figure(figure, title: str, data: dict, cells: list[Cells]) -> Figure:
    """A ``qgraph.Figure`` of the matplotlib ``figure`` whose HTML form answers a hover on ``cells``."""
    return Figure.from_matplotlib(figure, title, data, html=lambda svg, key: hover_html(svg, key, figure, cells))


def hover_html(svg: str, key: str, figure, cells: list[Cells]) -> str:
    """The HTML fragment: ``svg`` (matplotlib's drawing of ``figure``, laid out) with a hit rect per grid,
    the tooltip, the grids as JSON and the script reading them. ``key`` is the fragment's element id."""
    height = figure.get_figheight() * 72  # the SVG's units are points; display pixels are at figure.dpi
    rects, grids = [], []
    for index, grid in enumerate(cells):
        x, y, width, tall, flipped, top = _box(grid, figure.dpi, height)
        rects.append(f'<rect class="qg-hit" data-grid="{index}" x="{x:.2f}" y="{y:.2f}" width="{width:.2f}" '
                     f'height="{tall:.2f}" fill="none" pointer-events="all"/>')
        grids.append(_grid_data(grid, [x, y, width, tall], flipped, top))
    layer = ('<g class="qg-hover">' + "".join(rects) + '<rect class="qg-mark" fill="none" stroke="#111" '
             'stroke-width="1.2" pointer-events="none" visibility="hidden"/></g>')
    head, _, tail = inline_svg(svg, "#" + key).rpartition("</svg>")
    payload = json.dumps(grids, ensure_ascii=False, separators=(",", ":")).replace("</", "<\\/")
    return (f'<div class="qgraph-figure" id="{key}" style="position:relative">'
            f"<style>{_CSS.replace('KEY', key)}</style>{head}{layer}</svg>"
            f'<div class="qg-tip" role="tooltip"></div>'
            f'<script type="application/json" class="qg-grids">{payload}</script>'
            f"<script>{_JS.replace('KEY', key)}</script></div>")


def _box(grid: Cells, dpi: float, height: float) -> tuple[float, float, float, float, bool, bool]:
    """The grid's rect in the SVG's points ``(x, y, width, height)``, whether its first column is on the
    right (``flipped``), and whether its first row is at the top."""
    rows, columns = grid.values.shape
    data, whole = grid.axes.transData, grid.axes.transAxes
    across = [float(data.transform((c, 0))[0]) for c in (-0.5, columns - 0.5)] if grid.span != "rows" \
        else [float(whole.transform((a, 0))[0]) for a in (0, 1)]
    down = [float(data.transform((0, r))[1]) for r in (-0.5, rows - 0.5)] if grid.span != "columns" \
        else [float(whole.transform((0, a))[1]) for a in (1, 0)]  # display y grows upwards: row 0 on top
    scale = 72 / dpi
    x, y = min(across) * scale, height - max(down) * scale
    return x, y, abs(across[1] - across[0]) * scale, abs(down[1] - down[0]) * scale, across[0] > across[1], \
        down[0] > down[1]


def _grid_data(grid: Cells, box: list[float], flipped: bool, top: bool) -> dict:
    values = grid.values.detach().float().cpu()
    rows, columns = values.shape
    if len(grid.rows) != rows or len(grid.columns) != columns:
        raise InternalError(f"hover labels {len(grid.rows)} x {len(grid.columns)} for a grid {rows} x {columns}")
    data = {"rows": grid.rows, "columns": grid.columns, "what": grid.what, "panel": grid.panel,
            "values": " ".join(cell_text(v) for v in values.flatten().tolist()), "box": box,
            "flipped": flipped, "top": top}
    if grid.notes is not None:
        data["notes"] = [note for row in grid.notes for note in row]
    return data


def cell_text(value: float) -> str:
    """A cell's value as the tooltip shows it: 3 significant digits; "-" for a blank (NaN) cell."""
    return "-" if value != value else format(value, ".3g")


_CSS = """#KEY { display: inline-block; max-width: 100%; }
#KEY svg { max-width: 100%; height: auto; display: block; }
#KEY .qg-tip { position: absolute; display: none; pointer-events: none; z-index: 10; white-space: pre;
  background: rgba(255, 255, 255, 0.96); border: 1px solid #888; border-radius: 4px; padding: 4px 7px;
  font: 12px/1.35 system-ui, -apple-system, "Segoe UI", sans-serif; color: #111;
  box-shadow: 0 1px 4px rgba(0, 0, 0, 0.25); }
#KEY .qg-tip b { font-weight: 600; }"""

_JS = """(function () {
  var root = document.getElementById("KEY");
  if (!root || root.getAttribute("data-ready")) return;
  root.setAttribute("data-ready", "1");
  var grids = JSON.parse(root.querySelector("script.qg-grids").textContent);
  var tip = root.querySelector(".qg-tip"), mark = root.querySelector(".qg-mark");
  grids.forEach(function (g) { g.cells = g.values.split(" "); });
  function line(text) { var div = document.createElement("div"); div.textContent = text; return div; }
  root.querySelectorAll("rect.qg-hit").forEach(function (hit) {
    var g = grids[+hit.getAttribute("data-grid")], rows = g.rows.length, cols = g.columns.length;
    hit.addEventListener("mousemove", function (event) {
      var b = hit.getBoundingClientRect();
      var c = Math.min(cols - 1, Math.max(0, Math.floor((event.clientX - b.left) / b.width * cols)));
      var r = Math.min(rows - 1, Math.max(0, Math.floor((event.clientY - b.top) / b.height * rows)));
      mark.setAttribute("x", g.box[0] + c * g.box[2] / cols); mark.setAttribute("width", g.box[2] / cols);
      mark.setAttribute("y", g.box[1] + r * g.box[3] / rows); mark.setAttribute("height", g.box[3] / rows);
      mark.setAttribute("visibility", "visible");
      if (g.flipped) c = cols - 1 - c;
      if (!g.top) r = rows - 1 - r;
      var value = g.cells[r * cols + c];
      tip.textContent = "";
      [g.panel, g.rows[r], g.columns[c]].forEach(function (t) { if (t) tip.appendChild(line(t)); });
      var shown = line(g.what + ": "), number = document.createElement("b");
      number.className = "qg-value"; number.textContent = value === "-" ? "blank" : value;
      shown.appendChild(number); tip.appendChild(shown);
      if (g.notes && g.notes[r * cols + c]) tip.appendChild(line(g.notes[r * cols + c]));
      tip.setAttribute("data-row", r); tip.setAttribute("data-col", c); tip.setAttribute("data-value", value);
      var place = root.getBoundingClientRect();
      tip.style.display = "block";
      var left = event.clientX - place.left + 14, topAt = event.clientY - place.top + 14;
      if (left + tip.offsetWidth > root.clientWidth) left = Math.max(0, left - tip.offsetWidth - 28);
      tip.style.left = left + "px"; tip.style.top = topAt + "px";
    });
    hit.addEventListener("mouseleave", function () {
      tip.style.display = "none"; mark.setAttribute("visibility", "hidden");
    });
  });
})();"""
