"""The hyper-connections' pictures (``qwen4_exp``'s residual streams): how much each stream carries, and the
weights each block writes into the streams with, from the values laid out ``Streams [batch seq streams
hidden_size]`` and ``Injection [batch seq streams]``.

====================================================  =========================================================
``out.plot(...)``                                     what the figure shows
====================================================  =========================================================
``"layers.*.layer_output"`` (a glob of ``Streams``)   how much each stream carries after each block: blocks
                                                      (up) × streams, each cell the stream's norm, its mean
                                                      over the row's tokens (``position=``: at one token)
``"layers.*.*_mix.injection_weights"``               the weight each mix's mixer (MLP) writes into each
(a glob of ``Injection``)                             stream with: mixes (up) × streams, likewise
``"layers.2.layer_output"``, ``"layers.1.mlp_mix.     one value: streams (down) × tokens (across; a left-
injection_weights"`` (one value)                      padded row's pads are not drawn), each cell the
                                                      stream's norm (weight) at that token
====================================================  =========================================================

A ``Streams`` value is read per stream as its norm (what the stream carries), except ``mix_weights`` (a weight
per channel), read as its mean over the channels (the stream's average weight in the mix). The grid's cell
is the mean over the row's real tokens (a pad's vector says nothing of the prompt) because one number per
block and stream is what "how much does this stream carry here" asks across a prompt; since one token (the
first, often) can carry norms many times the others', each cell's hover names the tokens where the stream
carries least and most, and ``position=`` draws one token's grid. Every cell's number is written in it.
"""
from __future__ import annotations

import re

import torch

from ..errors import InvalidArgument
from ..figure import Figure
from .common import (checked_index, common_tail, heading, kind_of, layout_of, new_figure, on_cpu,
                     short_names, spans, ticks, token_labels, value_of)
from .hover import Cells, hover_figure
from .scale import colour_bar, heatmap, scale_of, write_values

__all__ = ["stream_grid", "stream_tokens"]


def per_stream(out, name: str, batch: int) -> tuple[torch.Tensor, str]:
    """Value ``name``'s row ``batch`` as one number per token and stream ``[seq, streams]``, and what that number
    is: an injection weight as it is, a mix weight's mean over the channels, any other stream's norm."""
    value = on_cpu(value_of(out, name)[batch])
    if kind_of(layout_of(out, name)) == "Injection":
        return value, "injection weight"
    if name.endswith("mix_weights"):
        return value.mean(dim=-1), "mean mix weight"
    return value.norm(dim=-1), "norm"


def real_tokens(out, batch: int, seq: int) -> torch.Tensor:
    """Which of row ``batch``'s ``seq`` positions hold a token (not a pad), from the call's attention mask."""
    mask = getattr(out, "attention_mask", None)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == seq:
        return mask[batch].detach().cpu().bool()
    return torch.ones(seq, dtype=torch.bool)


def stream_tokens(out, name: str, tokens=None, tokenizer=None, *, batch: int = 0, position=None) -> Figure:
    """One value: its streams (down) × tokens (across)."""
    if position is not None:
        glob = re.sub(r"^layers[.][0-9]+[.]", "layers.*.", name)
        raise InvalidArgument(f"position={position!r} picks the token of a glob's grid (blocks × streams); one value "
                              f"draws every token: plot '{glob}' for the grid")
    rows = value_of(out, name).shape[0]
    batch = checked_index(batch, rows, "batch")
    numbers, what = per_stream(out, name, batch)
    every = token_labels(out, numbers.shape[0], tokens, batch, tokenizer)
    at = torch.nonzero(real_tokens(out, batch, numbers.shape[0])).flatten().tolist()  # a pad is not drawn
    grid = numbers[at].transpose(0, 1)  # [streams, tokens]
    labels = [every[p] for p in at]
    streams = [f"stream {s}" for s in range(grid.shape[0])]
    scale = scale_of(grid)
    figure = new_figure(min(14.0, max(4.5, 0.16 * len(labels) + 2.4)), max(2.0, 0.3 * len(streams) + 1.5))
    axes = figure.add_subplot()
    colour_bar(figure, heatmap(axes, grid, scale), axes, what)
    ticks(axes, labels, "x", rotate=True)
    ticks(axes, streams, "y")
    axes.set_title(f"each stream's {what} at each token", fontsize=8)
    figure.suptitle(heading(name, batch=batch, rows=rows), fontsize=10)
    return hover_figure(figure, name, {"grid": grid, "positions": at, "tokens": labels, "what": what,
                                       "limits": (scale.low, scale.high)},
                        [Cells(axes, grid, streams, [f"token {p}: {every[p]}" for p in at], what)])


def stream_grid(out, names: list[str], tokens=None, tokenizer=None, *, batch: int = 0, position=None) -> Figure:
    """A glob's values: blocks (up) × streams, at ``position`` or the mean over the row's real tokens."""
    shapes = {tuple(value_of(out, n).shape[:3]) for n in names}
    if len(shapes) > 1:
        raise InvalidArgument(f"the values {', '.join(names)} differ in batch, tokens or streams ({sorted(shapes)}): "
                              f"plot them one by one")
    rows = value_of(out, names[0]).shape[0]
    batch = checked_index(batch, rows, "batch")
    read = [per_stream(out, n, batch) for n in names]
    what = read[0][1]
    each = torch.stack([numbers for numbers, _ in read])  # [values, seq, streams]
    labels = token_labels(out, each.shape[1], tokens, batch, tokenizer)
    real = real_tokens(out, batch, each.shape[1])
    streams = [f"stream {s}" for s in range(each.shape[2])]
    if position is None:
        grid = each[:, real].mean(dim=1)
        where = f"mean over the row's {int(real.sum())} tokens" if not real.all() else \
            f"mean over the {len(labels)} tokens"
        notes = _extremes(each, real, labels)
    else:
        position = checked_index(position, len(labels), "position")
        if not real[position]:
            raise InvalidArgument(f"position {position} of row {batch} is padding: pick one of its tokens "
                                  f"({int(torch.nonzero(real)[0])} to {len(labels) - 1})")
        grid, where, notes = each[:, position], f"token {position}: {labels[position]}", None
    scale = scale_of(grid)
    short = short_names(names)
    figure = new_figure(max(4.2, 0.75 * len(streams) + 2.4 + 0.05 * max(map(len, short))),
                        max(2.4, 0.28 * len(names) + 1.5))
    axes = figure.add_subplot()
    colour_bar(figure, heatmap(axes, grid, scale, origin="lower"), axes, what)
    write_values(axes, grid, scale, digits=3)
    ticks(axes, streams, "x")
    ticks(axes, short, "y")
    axes.set_title(f"each stream's {what}, {where}", fontsize=8, parse_math=False)
    blocks = [int(found[1]) for found in (re.match(r"layers\.(\d+)\.", n) for n in names) if found]
    figure.suptitle(heading(" · ".join(common_tail(names)) or names[0], batch=batch, rows=rows,
                            extra=spans("block", sorted(set(blocks))) if len(blocks) == len(names) else ""),
                    fontsize=10)
    return hover_figure(figure, f"{len(names)} values", {
        "grid": grid, "each": each, "names": names, "rows": short, "tokens": labels, "position": position,
        "what": what, "limits": (scale.low, scale.high)}, [Cells(axes, grid, names, streams, what, notes=notes)])


def _extremes(each: torch.Tensor, real: torch.Tensor, labels: list[str]) -> list[list[str]]:
    """For each value and stream, the real tokens where its number is least and most (the hover's note)."""
    kept = torch.nonzero(real).flatten()
    shown = each[:, kept]  # [values, tokens, streams]
    least, most = shown.min(dim=1), shown.max(dim=1)

    def at(k: int) -> str:
        return f"{int(kept[k])}: {labels[int(kept[k])]}"
    return [[f"least {float(least.values[v, s]):.3g} at token {at(int(least.indices[v, s]))}, most "
             f"{float(most.values[v, s]):.3g} at token {at(int(most.indices[v, s]))}"
             for s in range(each.shape[2])] for v in range(each.shape[0])]
