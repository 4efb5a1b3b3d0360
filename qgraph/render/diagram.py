"""What a picture holds before it is DOT: boxes, wires, clusters and a legend, all plain data.

``block.py`` and ``model.py`` build a ``Diagram`` from the exported graph; ``dot.py`` styles it and
hands it to Graphviz. Keeping the two apart lets tests read the structure without parsing DOT.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field


@dataclass
class Box:
    """One drawn node. ``label`` is Graphviz HTML (without the outer ``<>``); ``kind`` picks its style."""

    id: str
    label: str
    kind: str
    cluster: str | None = None
    tooltip: str = ""
    attrs: dict = field(default_factory=dict)


@dataclass
class Wire:
    """One drawn edge; ``kind`` picks its style (data, spine, context, ghost). ``streams`` > 1: a residual
    stream that many streams wide, drawn as a bundle of that many lines."""

    src: str
    dst: str
    kind: str = "data"
    label: str = ""
    attrs: dict = field(default_factory=dict)
    streams: int = 1


@dataclass
class Cluster:
    """A module scope drawn as a box around its members; ``parent`` nests clusters."""

    key: str
    label: str
    kind: str
    parent: str | None = None


@dataclass
class Diagram:
    title: str
    boxes: dict[str, Box] = field(default_factory=dict)
    wires: list[Wire] = field(default_factory=list)
    clusters: dict[str, Cluster] = field(default_factory=dict)
    legend: list[tuple[str, str]] = field(default_factory=list)  # (box kind, text)
    same_rank: list[list[str]] = field(default_factory=list)  # boxes drawn side by side

    def add(self, box: Box) -> Box:
        self.boxes.setdefault(box.id, box)
        return self.boxes[box.id]

    def connect(self, src: str, dst: str, kind: str = "data", label: str = "", **attrs) -> Wire:
        wire = Wire(src, dst, kind, label, attrs)
        self.wires.append(wire)
        return wire

    def _repr_svg_(self) -> str | None:
        """Shown inline in a notebook (through Graphviz's ``dot``; without it the notebook shows the repr)."""
        from .dot import svg  # lazy: qgraph.render.dot imports this module's package at import time (a cycle)
        return svg(self)

    def taps(self) -> dict[str, Box]:
        """The value tap points by value name (a tap holding two values is listed under both)."""
        found = {}
        for box in self.boxes.values():
            for name in box.attrs.get("values", ()):
                found[name] = box
        return found


def esc(text) -> str:
    """Text made safe for a Graphviz HTML label."""
    return html.escape(str(text), quote=True)


def small(text, size: int = 9, color: str = "#555555") -> str:
    return f'<FONT POINT-SIZE="{size}" COLOR="{color}">{esc(text)}</FONT>'


def bold(text) -> str:
    return f"<B>{esc(text)}</B>"


def port_table(body: str, inputs=(), outputs=(), port_color: str = "#FFFFFF") -> str:
    """A box whose wires meet it at named ports: a row of inputs above ``body``, of outputs below.

    ``inputs``/``outputs`` are ``(port, text)`` pairs; a wire picks one with ``headport``/``tailport``.
    """
    span = math.lcm(len(inputs) or 1, len(outputs) or 1)

    def row(cells):
        if not cells:
            return ""
        width = span // len(cells)
        tds = "".join(f'<TD PORT="{port}" BGCOLOR="{port_color}" COLSPAN="{width}" CELLPADDING="1">'
                      f'{small(text, 8, "#444444")}</TD>' for port, text in cells)
        return f"<TR>{tds}</TR>"

    return (f'<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="3" CELLPADDING="0">{row(inputs)}'
            f'<TR><TD COLSPAN="{span}" CELLPADDING="2">{body}</TD></TR>{row(outputs)}</TABLE>')
