"""The picture of a decomposition (``out.logit_attribution(...).plot()``, ``out.residual_stack(...).plot()``):
one position a bar per component, several a components × positions grid, on a diverging scale centred
at zero (red adds, blue takes away), the components named as text."""
from __future__ import annotations

from ..errors import InvalidArgument
from ..figure import Figure
from .common import checked_index, decode, new_figure, ticks, tokenizer_of
from .hover import Cells, hover_figure
from .scale import colour_bar, heatmap, scale_of, write_values


def decomposition_figure(result, batch: int = 0, rows: int = 30) -> Figure:
    """``rows`` components (and bias terms) with the largest scores anywhere in ``batch``'s row, in stream
    order; the title says what the scores are (``result.what``) and what they sum to."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise InvalidArgument(f"rows={rows!r}: give a positive int (the most components drawn)")
    scores, labels = result.scored()  # [components, batch, positions], components and bias terms
    batch = checked_index(batch, scores.shape[1], "batch")
    grid = scores[:, batch].detach().float().cpu()  # [components, positions]
    keep = grid.abs().amax(dim=1).topk(min(rows, grid.shape[0])).indices.sort().values
    grid, names = grid[keep], [labels[i] for i in keep.tolist()]
    positions = result.positions
    ids = result.input_ids
    tokens = decode(ids[batch, positions].tolist(), tokenizer_of(result.source)) if ids is not None \
        else [str(p) for p in positions]
    columns = [f"{p}: {t}" for p, t in zip(positions, tokens)]
    scale = scale_of(grid, signed=True)
    limit = scale.high
    shown = f"the {len(names)} largest of {len(labels)}" if len(names) < len(labels) else f"all {len(labels)}"
    heading = f"{result.what()}  ·  batch {batch}" if scores.shape[1] > 1 else result.what()
    if len(positions) == 1:
        figure = new_figure(max(6.5, 4.6 + 0.07 * max(map(len, names))), max(2.4, 0.22 * len(names) + 1.3))
        axes = figure.add_subplot()
        values = grid[:, 0]
        axes.barh(range(len(names)), values.numpy(), color=["#c0392b" if v > 0 else "#2f6db5" for v in values])
        axes.axvline(0, color="black", linewidth=0.6)
        axes.set_xlim(-1.08 * limit, 1.08 * limit)
        axes.invert_yaxis()
        ticks(axes, names, "y")
        total = float(result.totals()[batch, 0])
        axes.set_xlabel(f"{result.unit} at {columns[0]}: {total:.4g} in all ({shown} components and bias terms "
                        f"drawn)", fontsize=8, parse_math=False)
        cells = Cells(axes, grid, names, [f"position {columns[0]}"], result.unit, span="rows")
    else:
        room = 0.07 * max(map(len, names))  # the components' names, left of the grid
        figure = new_figure(min(16.0, max(6.0, 0.5 * len(positions) + 2.2 + room)), max(2.4, 0.22 * len(names) + 1.5))
        axes = figure.add_subplot()
        colour_bar(figure, heatmap(axes, grid, scale), axes, result.unit)
        write_values(axes, grid, scale)
        ticks(axes, columns, "x", rotate=True)
        ticks(axes, names, "y")
        axes.set_title(f"{shown} components and bias terms, by their largest score", fontsize=8)
        cells = Cells(axes, grid, names, [f"position {column}" for column in columns], result.unit)
    figure.suptitle(heading, fontsize=10)
    return hover_figure(figure, result.what(), {"scores": grid, "labels": names, "positions": positions,
                                                "tokens": tokens, "limits": (scale.low, scale.high)}, [cells])
