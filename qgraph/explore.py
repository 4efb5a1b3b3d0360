"""``qgraph.explore``: one page (a ``qgraph.Figure``) to click through a model's annotated graph to its values.

The page holds the model's diagram and, for each kind of block (gated DeltaNet, gated attention, the
vision tower's), its first block's diagram as ``qgraph.render`` draws it; the blocks of one kind sit
in one ``<details>`` that collapses and expands, each other block of the kind a list of its values
(``blocks="all"`` draws every block). Every value is an element carrying ``data-value="<name>"``: a tap
box of a diagram (a box naming several values gets one strip per value) or a name in a list.
Clicking one fills the element ``id="detail"`` with its name, layout, description and availability
(from the catalogue, as ``qgraph.support`` gives it) and, when ``out`` holds it, its shape, dtype,
statistics (mean, std, min, max) and its plot (``out.plot``, drawn into the page beforehand); a value
that is not a tensor (``input_size``, a ``torch.Size``) shows as it is, ``(2, 70)``. The
page is self-contained: inline SVG, CSS and a few lines of JavaScript, nothing fetched.
"""
from __future__ import annotations

import html
import json
import re
import uuid
import xml.etree.ElementTree as ET

import torch

from .errors import InvalidArgument, InvalidType, OutOfRange, QgraphError
from .figure import Figure, inline_svg
from .interface import Instrument
from .render import render
from .plots import KINDS, kind_of, layout_of

__all__ = ["explore"]

_SVG, _XLINK = "http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"

_CSS = """#{key} {{ font-family: Helvetica, Arial, sans-serif; font-size: 13px; color: #222; }}
#{key} .qg-page {{ display: flex; gap: 12px; align-items: flex-start; }}
#{key} .qg-graphs {{ flex: 1 1 62%; min-width: 0; }}
#{key} .qg-graphs svg {{ max-width: 100%; height: auto; }}
#{key} [id=detail] {{ flex: 1 1 38%; position: sticky; top: 0; max-height: 100vh; overflow: auto;
  border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; background: #fcfcfc; }}
#{key} [id=detail] table {{ border-collapse: collapse; margin: 6px 0; }}
#{key} [id=detail] th {{ text-align: left; padding: 2px 10px 2px 0; color: #555; font-weight: normal;
  vertical-align: top; }}
#{key} [id=detail] td {{ padding: 2px 0; font-family: Menlo, Consolas, monospace; font-size: 12px; }}
#{key} [id=detail] svg {{ max-width: 100%; height: auto; }}
#{key} details {{ margin: 4px 0 4px 10px; }}
#{key} summary {{ cursor: pointer; font-weight: bold; padding: 2px 0; }}
#{key} [data-value] {{ cursor: pointer; }}
#{key} .qg-chip {{ display: inline-block; margin: 2px 3px; padding: 1px 6px; border: 1px solid #d9b23a;
  border-radius: 4px; background: #fff4cc; font-family: Menlo, Consolas, monospace; font-size: 11px; }}
#{key} .qg-chip.qg-held {{ background: #ffb25b; }}
#{key} .qg-chip.qg-selected {{ outline: 2px solid #d81b60; }}
#{key} g.qg-selected > path, #{key} g.qg-selected > polygon, #{key} g.qg-selected a > path,
#{key} g.qg-selected a > polygon, #{key} rect.qg-selected {{ stroke: #d81b60; stroke-width: 3px; }}
#{key} .qg-note {{ color: #666; font-size: 12px; margin: 4px 0; }}"""

# Plain ES5 and DOM calls only (no modules, no fetch): one click handler on the page's root finds the
# nearest element with data-value and fills #detail from the JSON the page carries.
_SCRIPT = """(function () {
  var root = document.getElementById("%(key)s");
  if (!root || root.getAttribute("data-ready")) { return; }
  root.setAttribute("data-ready", "1");
  var data = JSON.parse(root.querySelector("script.qg-data").textContent);
  var detail = root.querySelector("[id=detail]");
  var selected = null;
  function row(table, label, text) {
    var tr = document.createElement("tr"), th = document.createElement("th"), td = document.createElement("td");
    th.textContent = label; td.textContent = text; tr.appendChild(th); tr.appendChild(td); table.appendChild(tr);
  }
  function show(name) {
    var value = data[name] || {};
    detail.textContent = "";
    var title = document.createElement("h3");
    title.textContent = name; title.style.margin = "4px 0"; detail.appendChild(title);
    var table = document.createElement("table");
    row(table, "layout", value.layout || "(a module port)");
    row(table, "available", value.availability || "unknown");
    if (value.description) { row(table, "what", value.description); }
    if (value.role) { row(table, "here", value.role); }
    if (value.shape) {
      row(table, "shape", value.shape); row(table, "dtype", value.dtype);
      var stats = value.stats || {};
      ["mean", "std", "min", "max"].forEach(function (k) { if (k in stats) { row(table, k, stats[k]); } });
    } else if ("value" in value) {
      row(table, "value", value.value); row(table, "type", value.dtype);
    } else {
      row(table, "in out", "not captured by this call" + (data.__out__ ? "" : " (no out= given)"));
    }
    detail.appendChild(table);
    if (value.plot) {
      var plot = document.createElement("div");
      plot.className = "qg-plot"; plot.innerHTML = value.plot; detail.appendChild(plot);
      // a script set through innerHTML does not run: each plot's hover script (qgraph/plots/hover.py) made anew
      plot.querySelectorAll("script:not([type])").forEach(function (old) {
        var script = document.createElement("script"); script.textContent = old.textContent; old.replaceWith(script);
      });
    } else if (value.shape && value.noplot) {
      var note = document.createElement("div");
      note.className = "qg-note"; note.textContent = value.noplot; detail.appendChild(note);
    }
    detail.setAttribute("data-shown", name);
  }
  root.addEventListener("click", function (event) {
    var element = event.target;
    while (element && element !== root && !(element.getAttribute && element.getAttribute("data-value"))) {
      element = element.parentNode;
    }
    if (!element || element === root) { return; }
    if (selected && selected.classList) { selected.classList.remove("qg-selected"); }
    selected = element;
    if (element.classList) { element.classList.add("qg-selected"); }
    show(element.getAttribute("data-value"));
  });
})();"""


def explore(ig_or_model, out=None, *, blocks=None, plots: int = 32) -> Figure:
    """A page to click through the model's annotated graph to its values (see the module's docstring).

    ``ig_or_model``: an instrumented model (its captured values and edit slots are filled in their
    colours) or a model. ``out``: a call's ``Output``; the values it holds show their shape,
    statistics and plot. ``blocks``: which blocks get a diagram: by default the first block of each
    kind, ``"all"`` every block, or a list of block numbers. ``plots``: the most values plotted into
    the page (each plot is a few tens of KB; 0 for none). Returns a ``qgraph.Figure`` (shown in a
    notebook; ``.save("model.html")``)."""
    from .output import Output  # noqa: PLC0415 — likewise

    if isinstance(ig_or_model, Instrument):  # local, remote or loaded: its catalogue, family and config
        catalogue, family, config = ig_or_model.catalogue, ig_or_model.family, ig_or_model.config
        marks = {**{n: "captured by this instrument" for n in ig_or_model.values},
                 **{n: "an edit slot of this instrument" for n in getattr(ig_or_model, "slots", ())}}
        model = getattr(ig_or_model, "model", None)  # the diagrams are drawn where the model is
    elif hasattr(ig_or_model, "config") and hasattr(ig_or_model, "named_modules"):
        from .families import family_for  # noqa: PLC0415 — as above
        from .values.support import support  # noqa: PLC0415 — as above
        model, catalogue, marks = ig_or_model, support(ig_or_model).catalogue, {}
        family, config = family_for(model), model.config
    else:
        raise InvalidType(f"explore takes a Qwen3.5 model or an instrument (qgraph.instrument(...), "
                          f"qgraph.remote(...).instrument(...), qgraph.load(...)), not {type(ig_or_model).__name__}")
    if out is not None and not isinstance(out, Output):
        raise InvalidType(f"out= takes what an instrumented call returns (an Output), not {type(out).__name__}")
    if not isinstance(plots, int) or isinstance(plots, bool) or plots < 0:
        raise InvalidArgument(f"plots={plots!r}: give the most values to plot, an int >= 0")
    mixers = family.block_mixers(config)
    drawn = _drawn_blocks(blocks, mixers)
    drawer = ig_or_model if model is not None else None  # what the diagrams are drawn from
    later = "" if model is None else " (its values; blocks=\"all\" draws it)"  # of a block without its diagram

    key = f"qg-{uuid.uuid4().hex[:10]}"
    shown: set[str] = set()  # names that have an element on the page
    parts = [] if model is not None else [  # a server's or a saved program's: its catalogue alone, no module tree
        '<div class="qg-note">The model runs elsewhere (a server or a saved program), so no diagram is drawn here '
        '(qgraph.explore(model) where the model is draws them): the values are listed by block.</div>']
    parts += [_section("the model", _diagram(drawer, "model", None, catalogue, shown),
                      _model_values(catalogue), shown, catalogue, out, opened=True)]
    kinds = family.kinds(config)
    for mixer in dict.fromkeys(mixers):
        members = [b for b, m in enumerate(mixers) if m == mixer]
        inner = []
        for block in members:
            values = _block_values(catalogue, f"layers.{block}")
            diagram = _diagram(drawer, "block", block, catalogue, shown) if block in drawn else ""
            inner.append(_section(f"block {block}" + ("" if diagram else later), diagram, values, shown, catalogue,
                                  out, opened=bool(diagram) or (model is None and block == members[0])))
        title = f"{family.title(mixer)} blocks ({kinds[members[0]]}): {_ranges(members)}"
        parts.append(f'<details open class="qg-kind"><summary>{html.escape(title)}</summary>{"".join(inner)}</details>')
    depth = family.vision_blocks(config)
    if depth:
        inner = []
        for block in range(depth):
            values = _block_values(catalogue, f"vision.layers.{block}")
            diagram = _diagram(drawer, "vision_block", block, catalogue, shown) \
                if block == 0 or blocks == "all" else ""
            title = f"vision block {block}" + ("" if diagram else later)
            inner.append(_section(title, diagram, values, shown, catalogue, out, opened=bool(diagram)))
        parts.append(f'<details open class="qg-kind"><summary>vision encoder blocks: 0-{depth - 1}</summary>'
                     f'{"".join(inner)}</details>')
    if out is not None:  # what out holds and no list above shows (module ports, say)
        rest = [n for n in out.values if n not in shown]
        if rest:
            parts.append(_section(f"other captured values ({len(rest)})", "", rest, shown, catalogue, out,
                                  opened=False))

    data: dict[str, object] = {name: _facts(name, catalogue, marks) for name in shown}  # and "__out__": captured?
    if out is not None:
        _add_captured(data, out, plots)
    data["__out__"] = out is not None
    payload = json.dumps(data, allow_nan=False).replace("<", "\\u003c").replace(">", "\\u003e")
    page = (f'<div class="qgraph-explore" id="{key}"><style>{_CSS.format(key=key)}</style>'
            f'<div class="qg-page"><div class="qg-graphs">{"".join(parts)}</div>'
            f'<div id="detail">Click a value (a box of a diagram, or a name in a list) to see it here.</div></div>'
            f'<script type="application/json" class="qg-data">{payload}</script>'
            f'<script>{_SCRIPT % {"key": key}}</script></div>')
    return Figure(html=page, title=f"explore {type(model).__name__ if model is not None else family.name}")


# -- the page's parts -----------------------------------------------------------------------------------
def _drawn_blocks(blocks, mixers) -> set[int]:
    if blocks is None:
        return {mixers.index(m) for m in dict.fromkeys(mixers)}
    if blocks == "all":
        return set(range(len(mixers)))
    if isinstance(blocks, int) and not isinstance(blocks, bool):
        blocks = [blocks]
    if not isinstance(blocks, (list, tuple, range)):
        raise InvalidType(f"blocks= takes None, \"all\" or a list of block numbers, not {type(blocks).__name__}")
    chosen = set()
    for block in blocks:
        if not isinstance(block, int) or not -len(mixers) <= block < len(mixers):
            raise OutOfRange(f"block {block!r}: the model has blocks 0 to {len(mixers) - 1}")
        chosen.add(block % len(mixers))
    return chosen


def _section(title: str, diagram: str, values, shown: set, catalogue, out, opened: bool) -> str:
    """A ``<details>`` with a diagram and chips for the values it does not show."""
    chips = [_chip(name, catalogue, out) for name in values if name not in shown]
    shown.update(values)
    rest = ""
    if chips:
        note = "also here, not drawn as a box:" if diagram else "values:"
        rest = f'<div class="qg-note">{note}</div><div>{"".join(chips)}</div>'
    return (f'<details{" open" if opened else ""} class="qg-block"><summary>{html.escape(title)}</summary>'
            f'{diagram}{rest}</details>')


def _chip(name: str, catalogue, out) -> str:
    held = out is not None and name in out.values
    entry = catalogue.get(name)
    return (f'<span class="qg-chip{" qg-held" if held else ""}" data-value="{html.escape(name)}" '
            f'title="{html.escape(entry.layout if entry is not None else "")}">{html.escape(name)}</span>')


def _block_values(catalogue, prefix: str) -> list[str]:
    """The standard values of one block (what its diagram draws), in catalogue order."""
    return [name for name, entry in catalogue.items() if not entry.port
            and (entry.host == prefix or entry.host.startswith(prefix + "."))]


def _model_values(catalogue) -> list[str]:
    return [name for name, entry in catalogue.items() if not entry.port
            and not re.match(r"^(vision\.)?layers\.\d+", entry.host)]


def _diagram(ig_or_model, what: str, layer, catalogue, shown: set) -> str:
    """A diagram's inline SVG, each value's element tagged with ``data-value`` (marked in ``shown``); "" where
    the model runs elsewhere (a server, a saved program: no module tree here to draw)."""
    if ig_or_model is None:
        return ""
    import graphviz

    try:
        svg = render(ig_or_model, what=what, layer=layer).pipe(format="svg", encoding="utf-8", quiet=True)
    except graphviz.ExecutableNotFound:
        return ('<div class="qg-note">Graphviz\'s dot program is not installed, so the diagram is not drawn '
                '(apt-get install graphviz); the values are listed below.</div>')
    tagged, names = tag_values(svg, set(catalogue))
    shown.update(names)
    return inline_svg(tagged)


def tag_values(svg: str, names: set[str]) -> tuple[str, list[str]]:
    """A diagram's SVG (``qgraph.render``'s: each tap box's ``id`` is its values' names joined by ``+``)
    with ``data-value="<name>"`` on each value's box, or one strip over the box per value where a box
    names several; and the names tagged."""
    ET.register_namespace("", _SVG)
    ET.register_namespace("xlink", _XLINK)
    root = ET.fromstring(re.sub(r"<!DOCTYPE[^>]*>", "", svg).encode("utf-8"))
    tagged = []
    for group in root.iter(f"{{{_SVG}}}g"):
        if group.get("class") != "node":
            continue
        values = [name for name in (group.get("id") or "").split("+") if name in names]
        if len(values) == 1:
            group.set("data-value", values[0])
            group.set("class", "node qg-value")
        elif values:
            left, top, right, bottom = _box(group)
            band = (bottom - top) / len(values)
            for k, name in enumerate(values):
                strip = ET.SubElement(group, f"{{{_SVG}}}rect", {
                    "x": f"{left:.2f}", "y": f"{top + k * band:.2f}", "width": f"{right - left:.2f}",
                    "height": f"{band:.2f}", "fill": "#ffffff", "fill-opacity": "0", "pointer-events": "all",
                    "class": "qg-value", "data-value": name})
                ET.SubElement(strip, f"{{{_SVG}}}title").text = name
        tagged.extend(values)
    return ET.tostring(root, encoding="unicode"), tagged


def _box(group) -> tuple[float, float, float, float]:
    """The bounding box of a node's outline (its first path, polygon or ellipse)."""
    for element in group.iter():
        tag = element.tag.rsplit("}", 1)[-1]
        if tag == "ellipse":
            x, y, rx, ry = (float(element.get(k, 0)) for k in ("cx", "cy", "rx", "ry"))
            return x - rx, y - ry, x + rx, y + ry
        points = element.get("d") if tag == "path" else element.get("points") if tag == "polygon" else None
        if points:
            numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", points)]
            xs, ys = numbers[0::2], numbers[1::2]
            return min(xs), min(ys), max(xs), max(ys)
    return 0.0, 0.0, 0.0, 0.0


# -- what a click shows ---------------------------------------------------------------------------------
def _facts(name: str, catalogue, marks: dict) -> dict:
    entry = catalogue.get(name)
    if entry is None:
        return {"availability": "not a value of this model's catalogue"}
    facts = {"layout": entry.layout, "description": entry.description, "availability": entry.availability}
    if name in marks:
        facts["role"] = marks[name]
    return facts


def _add_captured(data: dict, out, plots: int) -> None:
    """Shape, dtype, statistics and (for the first ``plots`` values with a plot) the plot of every value
    ``out`` holds."""
    budget = plots
    for name, value in out.values.items():
        if name not in data:
            continue
        facts = data[name]
        tensors = _tensors(value)
        if tensors is None:  # a plain value (input_size, a torch.Size): shown as it is, no statistics
            facts["value"], facts["dtype"] = _plain(value), type(value).__name__
            continue
        facts["shape"] = " ".join(f"[{' '.join(map(str, t.shape))}]" for t in tensors)
        facts["dtype"] = str(tensors[0].dtype).replace("torch.", "")
        facts["stats"] = _stats(tensors)
        if kind_of(layout_of(out, name)) is None:
            facts["noplot"] = "no plot for this layout (plots: " + ", ".join(KINDS) + ")"
            continue
        if budget <= 0:
            facts["noplot"] = f"not plotted here (explore plots the first {plots} values; pass plots=N for more)"
            continue
        try:
            facts["plot"] = out.plot(name)._repr_html_()  # the figure that answers a hover
            budget -= 1
        except QgraphError as why:
            facts["noplot"] = f"no plot: {why}"


def _tensors(value) -> list | None:
    """The tensors a captured value holds (a tensor, or a list of them: per-image patterns), or None
    for a value that is not tensors (``input_size``, a ``torch.Size``; an int)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    return None


def _plain(value) -> str:
    """A value that is not a tensor, as the page shows it: ``(1, 9)`` for a ``torch.Size``."""
    return str(tuple(value)) if isinstance(value, torch.Size) else str(value)


def _stats(tensors) -> dict:
    flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
    flat = flat[torch.isfinite(flat)]
    if not flat.numel():
        return {"mean": "no finite values"}
    spread = float(flat.std()) if flat.numel() > 1 else 0.0
    return {key: f"{value:.6g}" for key, value in
            (("mean", float(flat.mean())), ("std", spread), ("min", float(flat.min())), ("max", float(flat.max())))}


def _ranges(blocks: list[int]) -> str:
    return ", ".join(map(str, blocks))
