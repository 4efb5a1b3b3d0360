"""The logit lens's picture (``LogitLens.plot``): blocks (up) × positions (across), each cell the block's
top token there, coloured by its probability.

Sized to its content, so the text stays legible at any length: each cell is half an inch wide with its
token in 7.5 pt type, and a long prompt wraps, like a paragraph, into stacked grids of at most
``_PER_LINE`` positions each (``positions 24–47``) instead of one strip too wide to read. Past
``_LENS_TEXT`` positions the cells are drawn without their text in one compact grid; the HTML form's
hover still gives every cell's top tokens and probabilities.
"""
from __future__ import annotations

import math

from ..errors import InvalidArgument
from ..figure import Figure
from .common import checked_index, decode, new_figure, on_cpu, ticks, tokenizer_of
from .hover import Cells, hover_figure
from .scale import colour_bar, heatmap, scale_of

_LENS_TEXT = 128  # positions past which the grid is drawn compact, its cells without text
_PER_LINE = 24  # positions in one line of the wrapped grid
_CELL = (0.5, 0.24)  # a cell's width and height in inches
_CHARS = 7  # a cell's text, at most (longer tokens end in …)


def lens_figure(lens, tokenizer=None, batch: int = 0, tokens=None) -> Figure:
    """The figure (see the module's docstring); the x axis the input's token at each position (the lens
    reads the next one). A left-padded row's pads are not drawn (the lens holds them)."""
    if not lens:
        raise InvalidArgument("the logit lens is empty: nothing to draw")
    if tokenizer is None:
        tokenizer = tokenizer_of(getattr(lens, "_source", None))
    batch = checked_index(batch, lens.top_ids.shape[0], "batch")
    mask = lens.attention_mask
    real = [k for k, p in enumerate(lens.positions) if mask is None or bool(mask[batch, p])]
    if not real:
        raise InvalidArgument(f"row {batch}'s positions {lens.positions} are all padding: nothing to draw")
    ids = lens.top_ids[batch, :, real].cpu()  # [blocks, positions, top]
    top_probabilities = on_cpu(lens.top_probs[batch, :, real])
    probabilities = top_probabilities[..., 0]
    positions = [lens.positions[k] for k in real]
    blocks = ids.shape[0]
    cells = [decode(row.tolist(), tokenizer) for row in ids[..., 0]]
    words = decode(lens.input_ids[batch, positions].tolist(), tokenizer)
    whole = positions == list(range(positions[0], positions[0] + len(positions)))  # the tokens alone say it
    if tokens is not None:
        labels = [str(t) for t in tokens]
        if len(labels) != len(positions):
            raise InvalidArgument(f"tokens= has {len(labels)} labels for {len(positions)} positions"
                                  + (" (its row's real ones: pads are not drawn)" if mask is not None else ""))
    else:
        labels = [w if whole else f"{p}: {w}" for p, w in zip(positions, words)]
    scale = scale_of(probabilities, colours="Blues", zero=True)
    text = len(positions) <= _LENS_TEXT
    lines = math.ceil(len(positions) / _PER_LINE) if text else 1
    per = math.ceil(len(positions) / lines)
    longest = max(len(label) for label in labels)
    label_room = 0.35 + 0.065 * min(longest, 16)  # the rotated tick labels under each line
    width = per * _CELL[0] + 2.4 if text else min(16.0, max(5.0, 0.1 * len(positions) + 2.4))
    figure = new_figure(width, lines * (blocks * _CELL[1] + 0.45 + label_room) + 0.5)
    chunks = [range(start, min(start + per, len(positions))) for start in range(0, len(positions), per)]
    panels, hovers = [], []
    notes = [[" · ".join(f"{token} {float(p):.3g}" for token, p in zip(decode(ids[b, k].tolist(), tokenizer),
                                                                       top_probabilities[b, k]))
              for k in range(len(positions))] for b in range(blocks)]
    for line, chunk in enumerate(chunks):
        axes = figure.add_subplot(lines, 1, line + 1)
        picture = heatmap(axes, probabilities[:, chunk.start:chunk.stop], scale, origin="lower")
        if len(chunk) < per:  # the last line keeps the others' cell width
            axes.set_xlim(-0.5, per - 0.5)
        if text:
            for b in range(blocks):
                for k in chunk:
                    cell = cells[b][k]
                    axes.text(k - chunk.start, b, cell if len(cell) <= _CHARS else cell[:_CHARS - 1] + "…",
                              ha="center", va="center", fontsize=7.5, parse_math=False,
                              color="white" if probabilities[b, k] > 0.6 * scale.high else "black")
        ticks(axes, labels[chunk.start:chunk.stop], "x", rotate=longest > 5)
        ticks(axes, [f"block {b}" for b in range(blocks)], "y")
        if lines > 1:
            axes.set_title(f"positions {positions[chunk.start]}–{positions[chunk.stop - 1]}", fontsize=8, loc="left")
        panels.append(axes)
        hovers.append(Cells(axes, probabilities[:, chunk.start:chunk.stop], [f"block {b}" for b in range(blocks)],
                            [f"position {positions[k]}: {words[k]}" for k in chunk], "top-1 probability",
                            notes=[[f"top {ids.shape[-1]}: {row[k]}" for k in chunk] for row in notes]))
    panels[-1].set_xlabel("input token (each cell: the block's top guess at the next)", fontsize=8)
    colour_bar(figure, picture, panels, "top-1 probability")
    figure.suptitle("logit lens: each block's top token" + (f"  ·  batch {batch}" if batch else ""), fontsize=10)
    return hover_figure(figure, "logit lens", {"tokens": cells, "ids": ids[..., 0], "probabilities": probabilities,
                                               "positions": positions, "labels": labels,
                                               "limits": (scale.low, scale.high)}, hovers)
