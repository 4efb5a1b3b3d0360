"""QSA's picture (``qwen4_exp``'s sparse attention): which keys each query keeps, beside the full attention
pattern that the selection approximates.

``out.plot("layers.3.self_attn.selected_tokens")`` (a ``Selection [batch query key]`` value) draws row
``batch``'s selection, query (down) × key (across; a left-padded row's pads are not drawn): the kept keys
dark, the keys a query sees but drops light, what it cannot see (a later token) blank. Beside it, one
panel per head (``heads=[...]``, default all) of the full attention: the softmax, over every key the query
sees, of the same block's ``attention_queries`` · ``attention_keys`` / √head_dim (the pattern the block's
attention would have without the selection; its captured ``attention_probabilities`` are the same scores
over the kept keys alone), with the kept keys outlined. Each head's title says how much of its full
attention the kept keys hold, the mean over the queries; ``fig.data["kept_share"]`` has it per query.

The full pattern is computed from the captured queries and keys, so the output must hold them: capture
``attention_queries`` and ``attention_keys`` of the block with the selection (every head of each).
"""
from __future__ import annotations

import math

import torch

from ..errors import InvalidArgument, NotCaptured
from ..figure import Figure
from .common import (as_list, asked_option, checked_index, heading, new_figure, on_cpu, panel_side, ticks,
                     token_labels, value_of)
from .hover import Cells, hover_figure
from .scale import Scale, colour_bar, heatmap, scale_of
from .streams import real_tokens

__all__ = ["full_pattern", "outline", "selection_figure"]

KEPT = Scale("Greens", -0.6, 1.0)  # a kept key (1) dark green, a dropped one (0) light: both apart from a blank
OUTLINE = "#E4572E"  # the kept keys' outline on the full pattern


def selection_figure(out, name: str, tokens=None, tokenizer=None, *, batch: int = 0, heads=None) -> Figure:
    """The figure (see the module's docstring)."""
    selected = value_of(out, name)
    batch = checked_index(batch, selected.shape[0], "batch")
    pattern, visible = full_pattern(out, name, batch)
    count = pattern.shape[0]
    chosen = list(range(count)) if heads is None else [checked_index(h, count, "head")
                                                       for h in as_list(heads, "heads")]
    queries, keys = selected.shape[1:]
    every = token_labels(out, keys, tokens, batch, tokenizer)
    at = torch.nonzero(real_tokens(out, batch, keys)).flatten()  # the row's tokens: its pads are not drawn
    asked = at[at >= keys - queries]
    if not len(asked):
        raise InvalidArgument(f"row {batch}'s queries are all padding: nothing to draw")
    rows = asked - (keys - queries)  # the drawn queries' rows (the drawn keys' columns are `at`)
    kept = selected[batch].detach().cpu().bool()[rows][:, at]
    pattern, visible = pattern[chosen][:, rows][:, :, at], visible[rows][:, at]
    labels, query_labels = [every[p] for p in at.tolist()], [every[p] for p in asked.tolist()]
    key_cells = [f"key {p}: {every[p]}" for p in at.tolist()]
    query_cells = [f"query {p}: {every[p]}" for p in asked.tolist()]
    share = (pattern * kept).nansum(dim=-1).masked_fill(~visible.any(dim=-1), float("nan"))  # [heads, query]
    grid = torch.where(kept, 1.0, torch.where(visible, 0.0, float("nan")))
    scale = scale_of(pattern, colours="Blues", zero=True)
    panels = 1 + len(chosen)
    columns = min(panels, 3)
    lines = math.ceil(panels / columns)
    side = panel_side(len(labels))
    figure = new_figure(side * columns + 1.1, side * lines + 1.0)
    axes = figure.add_subplot(lines, columns, 1)
    heatmap(axes, grid, KEPT, aspect="equal")
    axes.set_title("QSA's selection: the kept keys (dark)\nof the keys each query sees (light)", fontsize=8)
    _label(axes, labels, query_labels, left=True)
    cells = [Cells(axes, grid, query_cells, key_cells, "kept", "QSA selection")]
    drawn = []
    for k, head in enumerate(chosen):
        axes = figure.add_subplot(lines, columns, k + 2)
        picture = heatmap(axes, pattern[k], scale, aspect="equal")
        _outline(axes, kept)
        axes.set_title(f"head {head}: the full attention\nthe kept keys (outlined) hold {_percent(share[k])}",
                       fontsize=8)
        _label(axes, labels, query_labels, left=(k + 1) % columns == 0)
        drawn.append(axes)
        cells.append(Cells(axes, pattern[k], query_cells, key_cells, "full attention", f"head {head}"))
    colour_bar(figure, picture, drawn, "full attention (no selection)")
    figure.suptitle(heading(name, batch=batch, rows=selected.shape[0], heads=chosen), fontsize=10)
    return hover_figure(figure, name, {"kept": kept, "visible": visible, "pattern": pattern, "kept_share": share,
                                       "heads": chosen, "tokens": labels, "queries": asked, "keys": at,
                                       "limits": (scale.low, scale.high)}, cells)


def full_pattern(out, name: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full attention of ``name``'s block in row ``batch`` ``[heads, query, key]`` (NaN where a query
    cannot see a key), and which keys each query sees ``[query, key]``."""
    block = name.rsplit(".", 1)[0]
    wanted = [f"{block}.attention_queries", f"{block}.attention_keys"]
    missing = [n for n in wanted if n not in out.values]
    if missing:
        raise NotCaptured(f"the full attention beside '{name}' is computed from the block's queries and keys, and "
                          f"this output lacks {', '.join(missing)}: capture them with it (values=[..., "
                          f"{', '.join(repr(n) for n in wanted)}])")
    for n in wanted:
        if asked_option(out, n, "heads") is not None:
            raise InvalidArgument(f"'{n}' was captured with heads=[...]: the full attention pairs each query head "
                                  f"with its key head, so capture every head of both")
    queries = on_cpu(value_of(out, wanted[0])[batch])  # [heads, query, head_dim]
    keys = on_cpu(value_of(out, wanted[1])[batch])  # [kv_heads, key, head_dim]
    heads, length = queries.shape[0], keys.shape[1]
    if heads % keys.shape[0]:
        raise InvalidArgument(f"{heads} query heads do not share {keys.shape[0]} key heads evenly")
    scores = queries @ keys.repeat_interleave(heads // keys.shape[0], dim=0).transpose(1, 2) / math.sqrt(
        queries.shape[-1])
    seen = queries.shape[1]
    real = real_tokens(out, batch, length)
    visible = (torch.arange(length)[None] <= torch.arange(length - seen, length)[:, None]) & real[None] \
        & real[length - seen:, None]
    pattern = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1).masked_fill(~visible, float("nan"))
    return pattern, visible


def outline(kept: torch.Tensor) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """The border of the kept cells of ``kept`` ``[rows, columns]``, as line segments in data coordinates (cell
    ``(r, c)`` centred at ``(c, r)``): each side of a kept cell whose neighbour there is not kept."""
    padded = torch.nn.functional.pad(kept, (1, 1, 1, 1))
    sides = {(-0.5, -0.5, -0.5, 0.5): kept & ~padded[1:-1, :-2], (0.5, -0.5, 0.5, 0.5): kept & ~padded[1:-1, 2:],
             (-0.5, -0.5, 0.5, -0.5): kept & ~padded[:-2, 1:-1], (-0.5, 0.5, 0.5, 0.5): kept & ~padded[2:, 1:-1]}
    return [((c + x0, r + y0), (c + x1, r + y1)) for (x0, y0, x1, y1), where in sides.items()
            for r, c in torch.nonzero(where).tolist()]


def _outline(axes, kept: torch.Tensor) -> None:
    from matplotlib.collections import LineCollection  # lazy: keeps matplotlib out of `import qgraph`
    axes.add_collection(LineCollection(outline(kept), colors=OUTLINE, linewidths=1.1, capstyle="projecting",
                                       label="kept keys"))


def _label(axes, labels: list[str], query_labels: list[str], left: bool) -> None:
    ticks(axes, labels, "x", rotate=True)
    ticks(axes, query_labels, "y")
    axes.set_xlabel("key token", fontsize=8)
    if left:
        axes.set_ylabel("query token", fontsize=8)


def _percent(share: torch.Tensor) -> str:
    mean = share[~share.isnan()].mean() if (~share.isnan()).any() else torch.tensor(float("nan"))
    return "-" if mean != mean else f"{float(mean):.0%}"
