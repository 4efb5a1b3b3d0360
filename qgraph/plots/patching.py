"""The picture of a patching sweep (``qgraph.patch(...).plot()``, ``qgraph.attribution_patch(...).plot()``):
each patched value's metric at each location, on a diverging scale centred at zero.

A sweep over the whole values (``positions=None, heads=None``) is one column, a value a row; over
positions or heads, values (down) × locations (across); over both, one panel per value, heads (down) ×
positions (across). Positions are labelled with the clean input's tokens, and each cell holds its
number while the grid is small enough to read them.
"""
from __future__ import annotations

import math

import torch

from ..errors import InvalidArgument
from ..figure import Figure
from .common import decode, new_figure, ticks, tokenizer_of
from .hover import Cells, hover_figure
from .scale import colour_bar, heatmap, scale_of, write_values


def patching_figure(result, tokens=None, tokenizer=None) -> Figure:
    """``result`` (a ``PatchResult``): see the module's docstring. ``tokens`` labels the positions (one
    string per position of the clean input), else its ids decoded by ``tokenizer`` (default: the model's)."""
    if not result:
        raise InvalidArgument("the patching result is empty: nothing to draw")
    names = list(result)
    grids = [torch.as_tensor(result[name]).detach().float().cpu() for name in names]
    ranks = {grid.dim() for grid in grids}
    if len(ranks) > 1 or ranks - {0, 1, 2}:
        raise InvalidArgument(f"the results have shapes {[tuple(g.shape) for g in grids]}: plot results of one "
                              f"patch call (one shape per location)")
    words = _words(result, tokens, tokenizer)
    rank = ranks.pop()
    unit = result.what
    if rank < 2:
        width = max(1, max(grid.numel() for grid in grids))
        grid = torch.full((len(names), width), float("nan"))
        for row, values in enumerate(grids):
            grid[row, :values.numel()] = values.flatten()
        axis = "positions" if result.positions is not None else "heads" if result.heads is not None else None
        columns = _labels(result, axis, width, words) if axis else ["whole value"]
        scale = scale_of(grid, signed=True)
        figure = new_figure(min(14.0, max(5.0, 0.42 * width + 3.4)), max(2.2, 0.3 * len(names) + 1.6))
        axes = figure.add_subplot()
        colour_bar(figure, heatmap(axes, grid, scale), axes, unit)
        write_values(axes, grid, scale)
        ticks(axes, columns, "x", rotate=_crowded(columns))
        ticks(axes, names, "y")
        cells = [Cells(axes, grid, names, columns, unit)]
        panels: list = [axes]
    else:  # [positions, heads] per value: a panel each, heads down, positions across
        positions = _labels(result, "positions", grids[0].shape[0], words)
        heads = _labels(result, "heads", grids[0].shape[1], words)
        scale = scale_of(torch.cat([g.flatten() for g in grids]), signed=True)
        across = min(len(names), 2)
        lines = math.ceil(len(names) / across)
        figure = new_figure(max(5.0, across * min(7.0, max(3.0, 0.4 * len(positions) + 1.4)) + 1.0),
                            lines * max(2.0, 0.3 * len(heads) + 1.3) + 0.6)
        panels, cells = [], []
        for k, (name, grid) in enumerate(zip(names, grids)):
            axes = figure.add_subplot(lines, across, k + 1)
            picture = heatmap(axes, grid.T, scale)
            write_values(axes, grid.T, scale)
            ticks(axes, positions, "x", rotate=_crowded(positions))
            ticks(axes, heads, "y")
            axes.set_title(name, fontsize=8)
            panels.append(axes)
            cells.append(Cells(axes, grid.T, heads, positions, unit, name))
        colour_bar(figure, picture, panels, unit)
    figure.suptitle(f"{result.title}  ·  {unit}", fontsize=10)
    return hover_figure(figure, result.title, {"names": names, "grids": grids, "limits": (scale.low, scale.high)},
                        cells)


def _words(result, tokens, tokenizer) -> list[str] | None:
    """A label per position of the clean input, or None where the result has no input ids."""
    ids = None if result.input_ids is None else torch.as_tensor(result.input_ids)
    if tokens is not None:
        words = [str(t) for t in tokens]
        if ids is not None and len(words) != ids.shape[-1]:
            raise InvalidArgument(f"tokens= has {len(words)} labels for {ids.shape[-1]} positions: give one per "
                                  f"position of the clean input")
        return words
    if ids is None:
        return None
    return decode(ids.reshape(-1, ids.shape[-1])[0].tolist(), tokenizer or tokenizer_of(result.source))


def _labels(result, axis: str, size: int, words: list[str] | None) -> list[str]:
    """The locations along ``axis`` (as the call asked them: "each" or a list) as text."""
    asked = getattr(result, axis)
    chosen = list(range(size)) if isinstance(asked, str) else list(asked)
    if axis == "heads":
        return [f"head {h}" for h in chosen]
    if words is None:
        return [str(p) for p in chosen]
    seq = len(words)
    return [f"{p % seq}: {words[p % seq]}" if -seq <= p < seq else str(p) for p in chosen]


def _crowded(labels: list[str]) -> bool:
    """Whether the labels of a row of cells stand up (many, or long) rather than lie along it."""
    return len(labels) > 8 or max(map(len, labels)) > 6
