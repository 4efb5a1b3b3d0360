"""The colour scale every heatmap qgraph draws uses: which colours, which limits, and the colour bar.

One rule for every figure, so the same kind of number reads the same everywhere: a signed value (one
that can go below zero: effective attention, a DeltaNet state, attribution and patching scores, MLP
neurons; or any grid holding a negative number) is drawn on a diverging map centred at zero (``RdBu_r``:
red above, blue below, white at zero) with symmetric limits, so zero is always the middle of the colour
bar; any other value on a sequential map from its least to its largest, stretched to reach zero for a
share (probabilities, norms, activations that start at zero; a log decay, all at or below zero, ends
at zero). Blank cells (NaN: a masked key, a pad) are white.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SIGNED = "RdBu_r"  # the diverging map of signed values
BLANK = "#ffffff"  # a NaN cell: nothing there


@dataclass(frozen=True)
class Scale:
    """A colour scale: the matplotlib colour map's name and the limits mapped to its ends."""

    colours: str
    low: float
    high: float

    @property
    def signed(self) -> bool:
        """Centred at zero: the limits are ``-m`` and ``m``."""
        return self.low == -self.high


def scale_of(values: torch.Tensor, *, signed: bool = False, colours: str = "viridis", zero: bool = False) -> Scale:
    """The scale of ``values`` (NaNs ignored): diverging and symmetric when ``signed`` or when the values
    hold both signs; else ``colours`` from the least value to the largest, reaching zero when ``zero``."""
    finite = values[torch.isfinite(values)].float()
    if not finite.numel():
        return Scale(SIGNED if signed else colours, -1.0 if signed else 0.0, 1.0)
    least, most = float(finite.min()), float(finite.max())
    if signed or least < 0 < most:
        bound = max(abs(least), abs(most)) or 1.0
        return Scale(SIGNED, -bound, bound)
    low, high = (min(least, 0.0), max(most, 0.0)) if zero else (least, most)
    return Scale(colours, low, high if high > low else low + 1.0)


def heatmap(axes, grid: torch.Tensor, scale: Scale, *, origin: str = "upper", aspect: str = "auto"):
    """``grid`` ``[rows, columns]`` drawn on ``axes`` in ``scale`` (one square per cell, never smoothed: the
    SVG keeps each cell crisp at any zoom); returns the image for ``colour_bar``."""
    import matplotlib  # lazy: keeps matplotlib out of `import qgraph` (figures import it when drawn)
    colours = matplotlib.colormaps[scale.colours].with_extremes(bad=BLANK)
    return axes.imshow(grid.float().numpy(), cmap=colours, vmin=scale.low, vmax=scale.high, origin=origin,
                       aspect=aspect, interpolation="none")


def colour_bar(figure, picture, axes, label: str):
    """The colour bar of ``picture`` beside ``axes`` (one axes, or a list sharing the bar), labelled."""
    bar = figure.colorbar(picture, ax=axes, shrink=0.9, pad=0.015, fraction=0.05)
    bar.set_label(label, fontsize=8)
    bar.ax.tick_params(labelsize=7)
    return bar


def write_values(axes, grid: torch.Tensor, scale: Scale, most: int = 400, digits: int = 2) -> None:
    """Each cell's number written in it (``digits`` significant digits; the small ones, under 5% of the
    scale, left to the colour) when ``grid`` has at most ``most`` cells: white on a dark cell, black on a
    light one (by the cell's colour, so it reads on any map)."""
    if grid.numel() > most:
        return
    import matplotlib  # lazy: keeps matplotlib out of `import qgraph` (figures import it when drawn)
    colours = matplotlib.colormaps[scale.colours]
    limit = max(abs(scale.low), abs(scale.high))
    for (row, column), value in zip(torch.cartesian_prod(torch.arange(grid.shape[0]), torch.arange(grid.shape[1])),
                                    grid.flatten().tolist()):
        if value == value and abs(value) >= 0.05 * limit:
            red, green, blue, _ = colours((value - scale.low) / (scale.high - scale.low))
            axes.text(int(column), int(row), f"{value:.{digits}g}", ha="center", va="center", fontsize=6,
                      color="white" if 0.299 * red + 0.587 * green + 0.114 * blue < 0.5 else "black")
