"""``out.plot(name)``: a picture (``qgraph.Figure``) of a captured value, drawn as its layout says.

=============================  ==========================================================================
layout (kind)                  what the figure shows
=============================  ==========================================================================
``Pattern``                    attention patterns (text, and the vision tower's per image): one panel
                               per head, query (down) × key (across), axes labelled with the tokens
``Gates``                      DeltaNet ``decays`` and ``betas``: heads (down) × tokens (across)
``States`` / ``State``         DeltaNet states: each head's state norm (Frobenius), heads × tokens (a bar
                               per head for ``state_output``/``state_input``), and one head's matrix
``Residual`` / ``Patches``     the residual stream: the norm per token; a glob (``layers.*.layer_output``)
                               is a grid of values (blocks, down) × tokens (across)
``Features`` / ``Neurons``     SAE and transcoder features (MLP neurons too): every token's top features,
                               as a grid of those features (down) × tokens (across)
``Streams`` / ``Injection``    hyper-connections' streams and injection weights: each stream's norm
                               (weight), streams × tokens; a glob is blocks (up) × streams, the mean
                               over the tokens or at ``position=`` (``plots.streams``)
``Selection``                  QSA's kept keys, query × key, beside each head's full attention with the
                               kept keys outlined (``plots.selection``)
=============================  ==========================================================================

Every heatmap has its colour bar (``plots.scale``: signed values diverging and centred at zero), tokens
on its axes and a title naming the value, its block and heads; the HTML form (``_repr_html_``, ``.html``)
answers a hover with the cell's value to 3 significant digits, its tokens (query and key, head, block,
feature) (``plots.hover``). Each figure keeps the numbers it drew in ``fig.data`` (tensors, on the CPU;
``limits``: its colour scale's). Options: ``batch=`` (the
row, default 0) for all; ``heads=[...]`` and ``image=`` (vision) for patterns; ``head=`` and
``position=`` (whose matrix) for states; ``top=`` (features per token) and ``rows=`` (the most features
drawn) for features; ``position=`` (one token; default the mean) for a glob of streams; ``heads=`` for a
selection. Tokens label the axes: ``tokens=[...]`` (strings, one per token) or, by default, the call's tokens,
decoded by ``tokenizer=`` or the model's tokenizer when its folder (``config.name_or_path``; a server's model
by its hub id; the Hugging Face cache, never the network) has one, else their ids.
"""
from __future__ import annotations

from collections.abc import Callable

from ..errors import InvalidArgument, InvalidType, NotSupported
from ..figure import Figure
from .common import KINDS, kind_of, layout_of  # noqa: F401 - explore reads these
from .draw import DRAW, residual_grid
from .lens_grid import lens_figure  # noqa: F401 - lens reads lens_figure
from .selection import selection_figure
from .streams import stream_grid, stream_tokens

__all__ = ["KINDS", "lens_figure", "plot"]

FIGURES = {**DRAW, "Streams": stream_tokens, "Injection": stream_tokens, "Selection": selection_figure}
# a glob's figure: one value per row; the values of one glob are all of one kind (Residual and Patches alike)
GRIDS: dict[str, Callable[..., Figure]] = {"Residual": residual_grid, "Patches": residual_grid,
                                           "Streams": stream_grid, "Injection": stream_grid}


# -- what to draw ---------------------------------------------------------------------------------------


def plot(out, name: str, tokens=None, tokenizer=None, **options) -> Figure:
    """What ``Output.plot`` returns (see the module's docstring)."""
    if not isinstance(name, str):
        raise InvalidType(f"plot takes a value's name (a string), not {type(name).__name__}")
    names = _select(out, name)
    kinds = {n: kind_of(layout_of(out, n)) for n in names}
    if len(names) > 1:
        kind, every = kinds[names[0]], set(kinds.values())
        if kind is None or not every <= set(GRIDS) or len({"Residual" if k == "Patches" else k for k in every}) > 1:
            found = ", ".join(f"{n} ({layout_of(out, n) or 'no layout'})" for n in names[:4])
            raise NotSupported(f"'{name}' selects {len(names)} values ({found}{', ...' if len(names) > 4 else ''}): a "
                               f"glob plots residual-stream values (blocks × tokens) or values of one kind of "
                               f"hyper-connection streams (blocks × streams); plot the others one by one")
        _check_options(kind, options)
        return GRIDS[kind](out, names, tokens, tokenizer, **options)
    name, kind = names[0], kinds[names[0]]
    if kind is None:
        layout = layout_of(out, name)
        what = f"layout {layout}" if layout else "no layout (a module port, or not known to this output)"
        raise NotSupported(f"'{name}' has {what}, which has no plot; these layouts plot: "
                           + ", ".join(f"{k} ({what})" for k, (what, _) in KINDS.items()))
    _check_options(kind, options)
    return FIGURES[kind](out, name, tokens, tokenizer, **options)


def _select(out, pattern: str) -> list[str]:
    """The captured names ``pattern`` (a name, alias or glob) selects, in block order."""
    if not any(c in pattern for c in "*?"):
        out[pattern]  # NotCaptured, as out[name] says it
        from ..values.names import canonical  # lazy: keeps sympy, transformers out until this is used
        return [canonical(pattern, out.blocks, out.aliases)]
    return out.select(pattern)


def _check_options(kind: str, options: dict) -> None:
    unknown = sorted(set(options) - set(KINDS[kind][1]))
    if unknown:
        raise InvalidArgument(f"plot options {unknown} are not for a {kind} value ({KINDS[kind][0]}); it takes "
                              f"{', '.join(KINDS[kind][1])} (and tokens=)")
