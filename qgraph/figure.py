"""``qgraph.Figure``: one picture type for every view qgraph draws (``out.plot``, ``ig.logit_lens(...).plot()``,
``qgraph.explore``, an attribution graph's ``.plot()``).

A figure shows itself in a notebook (``_repr_html_``) and saves as ``.html``, ``.svg`` or ``.png``
(what its kind has: a page of many diagrams saves as ``.html`` only). Everything it writes is
self-contained: inline SVG, CSS and JavaScript; no script, font or style sheet is fetched, so it works
offline (these machines and many clusters have no internet). Plots are drawn by matplotlib on its Agg
canvas (never a GUI window, and pyplot's global state is never touched): SVG for pages, PNG on request.
"""
from __future__ import annotations

import html
import io
import re
import uuid
from collections.abc import Callable
from pathlib import Path

from .errors import InvalidArgument, MissingFile

__all__ = ["Figure", "inline_svg"]

_PROLOG = re.compile(r"<\?xml[^>]*\?>|<!DOCTYPE[^>]*>|<!--.*?-->|<metadata>.*?</metadata>", re.S)
_XMLNS = re.compile(r'\s+xmlns(?::\w+)?="[^"]*"')


def inline_svg(svg: str, scope: str = "") -> str:
    """``svg`` (a standalone SVG document) as an element for an HTML page: no XML prolog, doctype,
    comments or metadata, and no namespace declarations (HTML knows SVG's; an inline SVG needs none),
    so the page names no URL at all. ``scope`` (a CSS selector) confines its style sheet's ``*`` rule
    (matplotlib writes one) to the figure instead of the whole page."""
    svg = _XMLNS.sub("", _PROLOG.sub("", svg)).strip()
    return re.sub(r"(<style[^>]*>)\s*\*\s*\{", lambda m: f"{m.group(1)}{scope} * {{", svg) if scope else svg


def _text(source: str | Callable[[], str]) -> str:
    return source() if callable(source) else source


class Figure:
    """A picture: shows itself in a notebook and ``save(path)`` writes ``.html``, ``.svg`` or ``.png``.

    ``svg`` is the standalone SVG (text, or a function making it on first use); ``html`` an HTML
    fragment shown instead of the inline SVG (a page with its own CSS and JS); ``png`` a function
    making the PNG bytes; ``data`` the numbers drawn (``fig.data``: a dict of what each panel shows,
    for reading or checking a plot without parsing its picture); ``title`` names it.
    """

    matplotlib: object  # set by from_matplotlib only: the matplotlib figure itself

    def __init__(self, svg: str | Callable[[], str] | None = None, *, html: str | Callable[[], str] | None = None,
                 png: Callable[[], bytes] | None = None, title: str = "qgraph figure", data: dict | None = None):
        if svg is None and html is None:
            raise InvalidArgument("a Figure needs its svg or its html")
        self._svg, self._html, self._png = svg, html, png
        self.title, self.data = title, dict(data or {})
        self.key = f"qg-{uuid.uuid4().hex[:10]}"

    @classmethod
    def from_matplotlib(cls, figure, title: str, data: dict | None = None, dpi: int = 110,
                        html: Callable[[str, str], str] | None = None) -> Figure:
        """A figure of a ``matplotlib.figure.Figure`` (made without pyplot): SVG with real text (searchable,
        no embedded glyphs), PNG at ``dpi``; ``html(svg, key)``, when given, makes its HTML form from the
        SVG (drawn, so laid out) and the fragment's element id (``plots.hover``: the SVG that answers a
        hover)."""
        drawn: dict[str, object] = {}

        def render(fmt: str):
            if fmt not in drawn:
                import matplotlib
                buffer = io.BytesIO()
                with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": None}):
                    figure.savefig(buffer, format=fmt, dpi=dpi if fmt == "png" else None,
                                   metadata={"Date": None} if fmt == "svg" else None)
                drawn[fmt] = buffer.getvalue().decode("utf-8") if fmt == "svg" else buffer.getvalue()
            return drawn[fmt]

        made = cls(lambda: render("svg"), png=lambda: render("png"), title=title, data=data,
                   html=None if html is None else lambda: html(made.svg, made.key))
        made.matplotlib = figure  # the matplotlib figure itself, to restyle before saving
        return made

    # -- what it is -----------------------------------------------------------------------------------
    @property
    def formats(self) -> tuple[str, ...]:
        """The file types ``save`` writes for this figure."""
        return ("html",) + (("svg",) if self._svg is not None else ()) + (("png",) if self._png is not None else ())

    @property
    def svg(self) -> str:
        """The picture as a standalone SVG document."""
        if self._svg is None:
            raise InvalidArgument(f"{self.title!r} is an HTML page, not one picture: save it as .html")
        if callable(self._svg):
            self._svg = self._svg()
        return self._svg

    def png(self) -> bytes:
        """The picture as PNG bytes."""
        if self._png is None:
            raise InvalidArgument(self._formats_message("png"))
        return self._png()

    # -- showing and saving ---------------------------------------------------------------------------
    def _repr_html_(self) -> str:
        if self._html is not None:
            self._html = _text(self._html)  # made once
            return self._html
        return (f'<div class="qgraph-figure" id="{self.key}"><style>#{self.key} svg {{ max-width: 100%; '
                f'height: auto; }}</style>{inline_svg(self.svg, "#" + self.key)}</div>')

    def to_html(self) -> str:
        """A whole HTML page of the figure (what ``save("x.html")`` writes)."""
        return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(self.title)}</title>'
                f'</head><body>\n{self._repr_html_()}\n</body></html>\n')

    def save(self, path: str | Path) -> Path:
        """Write the figure as its extension says: ``.html`` (the page, with its CSS and JS), ``.svg`` or
        ``.png`` (where the figure has them: ``fig.formats``). Returns the path."""
        path = Path(path)
        suffix = path.suffix.lower().lstrip(".")
        if suffix not in self.formats:
            raise InvalidArgument(self._formats_message(path.name))
        if not path.parent.is_dir():
            raise MissingFile(f"no folder {path.parent} to write {path.name} into")
        if suffix == "png":
            path.write_bytes(self.png())
        else:
            path.write_text(self.to_html() if suffix == "html" else self.svg, encoding="utf-8")
        return path

    def _formats_message(self, name: str) -> str:
        formats = " or ".join("." + f for f in self.formats)
        why = "" if not name.lower().endswith("png") else (
            " (a PNG comes from the figures matplotlib draws: out.plot, logit_lens(...).plot(); convert an .svg "
            "with rsvg-convert or cairosvg)")
        return f"this figure saves as {formats}, not '{name}'{why}"

    def __repr__(self) -> str:
        return f"Figure({self.title!r}; save as {', '.join('.' + f for f in self.formats)})"
