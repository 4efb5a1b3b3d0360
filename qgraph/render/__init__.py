"""Diagrams of a model drawn from its exported graph: one block with every value on it, or the model.

    qgraph.render(model, what="block", layer=3, path="block3.svg")          # modules and values
    qgraph.render(ig, what="block", layer=0, path="block0.png", detail="ops")  # every graph node
    qgraph.render(model, what="model", path="model.svg")

The picture is the program that runs: boxes are the module scopes and the ops of the exported graph,
wires are the tensors between them, and each standard value is a tap point on the wire that carries
it, labelled ``name [layout]``. Given an ``InstrumentedModel``, the values it captures and the values
it edits are filled in their own colours.
"""
from __future__ import annotations

from pathlib import Path

# the submodule diagram.py is imported here, before the function ``diagram`` below takes its name
from .diagram import Diagram  # noqa: F401
from ..errors import InvalidArgument, InvalidType, NoVisionEncoder, OutOfRange

__all__ = ["FORMATS", "GraphvizNotFound", "NoVisionEncoder", "diagram", "render"]

WHAT = ("block", "model", "vision_block")
DETAIL = ("modules", "ops")

_DOT = ("FORMATS", "GraphvizNotFound", "to_graphviz", "write")  # from dot.py, which imports graphviz


def __getattr__(name: str):
    """``dot.py``'s names, imported on first use (the ``qgraph`` command imports this package for
    ``WHAT`` and ``DETAIL`` without needing graphviz)."""
    if name in _DOT:
        from . import dot  # lazy: qgraph.render.dot imports this module's package at import time (a cycle)
        return getattr(dot, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_DOT))


def diagram(model_or_ig, what: str = "block", layer: int | None = None, *, detail: str = "modules", highlight=()):
    """The ``Diagram`` (boxes, wires, clusters) that ``render`` draws; see ``render`` for the arguments."""
    from ..export import export_model  # lazy: keeps torch, tqdm, transformers out until this is used
    from ..families import family_for  # lazy: keeps torch, transformers out until this is used
    # lazy: keeps safetensors, sympy, torch, tqdm, transformers out until this is used
    from ..instrument import InstrumentedModel
    from .block import block_diagram  # lazy: qgraph.render.block imports this module's package at import time (a cycle)
    from .graph import GraphView  # lazy: qgraph.render.graph imports this module's package at import time (a cycle)
    from .model import model_diagram  # lazy: qgraph.render.model imports this module's package at import time (a cycle)

    if what not in WHAT:
        raise InvalidArgument(f"what={what!r}: draw one of {', '.join(map(repr, WHAT))}")
    if detail not in DETAIL:
        raise InvalidArgument(f"detail={detail!r}: pick 'modules' (modules and values) or 'ops' (every graph node)")
    model, marks = _unpack(model_or_ig)
    family = family_for(model)
    mixers = family.block_mixers(model.config)
    if what == "vision_block":
        depth = family.vision_blocks(model.config)
        if not depth:
            raise NoVisionEncoder(f"the model has no vision encoder: {type(model).__name__} is text-only, so there "
                                  f"is no vision block to draw (draw what='block' or what='model' instead)")
        index = 0 if layer is None else layer
        if not -depth <= index < depth:
            raise OutOfRange(f"vision block {index}: the vision encoder has blocks 0 to {depth - 1}")
    if what == "block":
        if layer is None:  # the first attention block
            index = next((i for i, m in enumerate(mixers) if not family.mixer(m).recurrent), 0)
        else:
            index = layer
        if not -len(mixers) <= index < len(mixers):
            raise OutOfRange(f"block {index}: the model has blocks 0 to {len(mixers) - 1}")

    exported = model_or_ig.exported if isinstance(model_or_ig, InstrumentedModel) else export_model(model)
    view = GraphView(model, exported, requested=list(marks), saes=getattr(model_or_ig, "saes", None),
                     transcoders=getattr(model_or_ig, "transcoders", None))
    marks = dict(marks)
    if highlight:
        from ..values.names import resolve  # lazy: keeps sympy, torch, transformers out until this is used
        for name in resolve([highlight] if isinstance(highlight, str) else list(highlight),
                            view.catalogue, family, model.config):
            marks.setdefault(name, "value")
    if what == "model":
        return model_diagram(view, highlight=marks)
    if what == "vision_block":
        return block_diagram(view, index % depth, detail=detail, highlight=marks, vision=True)
    return block_diagram(view, index % len(mixers), detail=detail, highlight=marks)


def render(model_or_ig, what: str = "block", layer: int | None = None, path: str | Path | None = None, *,
           detail: str = "modules", highlight=(), dpi: int = 110):
    """Draw a block, the model, or (with a vision tower) a vision block, from the exported graph.

    ``model_or_ig``: a Qwen3.5 model (exported on first use) or a ``qgraph.instrument(...)`` result,
    whose captured values (``ig.values``) and edit slots (``ig.slots``) are drawn in their own colours.
    ``what``: "block" (``layer``, default the first attention block), "model", or "vision_block"
    (``layer`` of the vision encoder, default 0; only on a model with one).
    ``detail``: "modules" (modules, the ops between them, every value; readable at a glance) or "ops"
    (every graph node of the block, clustered by module scope).
    ``path``: where to write; the extension picks the format (.svg, .png, .pdf, .dot). Without a path
    the ``graphviz.Digraph`` is returned (it shows itself in a notebook; ``.source`` is the DOT).
    ``highlight``: more value names or globs to fill as instrumented.

    Rendering svg, png or pdf needs Graphviz's ``dot`` program; without it the ``.dot`` source is
    written next to ``path`` and ``GraphvizNotFound`` says how to install Graphviz.
    """
    # lazy: qgraph.render.dot imports this module's package at import time (a cycle)
    from .dot import FORMATS, to_graphviz, write

    if path is not None and Path(path).suffix.lstrip(".").lower() not in FORMATS:
        raise InvalidArgument(f"cannot render to '{Path(path).name}': the extension picks the format, one of "
                              f"{', '.join('.' + f for f in FORMATS)}")
    drawn = diagram(model_or_ig, what, layer, detail=detail, highlight=highlight)
    if path is None:
        return to_graphviz(drawn)
    return write(drawn, path, dpi=dpi)


def _unpack(model_or_ig):
    """(model, {value name: "value" | "edit"}) of a model or an InstrumentedModel."""
    # lazy: keeps safetensors, sympy, torch, tqdm, transformers out until this is used
    from ..instrument import InstrumentedModel

    if isinstance(model_or_ig, InstrumentedModel):
        marks = {name: "value" for name in model_or_ig.values}
        marks.update({name: "edit" for name in model_or_ig.slots})
        return model_or_ig.model, marks
    if hasattr(model_or_ig, "config") and hasattr(model_or_ig, "named_modules"):
        return model_or_ig, {}
    raise InvalidType(f"render takes a Qwen3.5 model or a qgraph.instrument(...) result, not "
                      f"{type(model_or_ig).__name__}")
