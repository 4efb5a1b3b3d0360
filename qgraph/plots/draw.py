"""One drawing per layout kind (``DRAW``): each a heatmap (or a line or bars over tokens) with its colour
scale (``plots.scale``), its tokens on the axes, a title naming the value, block and heads, and the
hover of its HTML form (``plots.hover``)."""
from __future__ import annotations

import math
import re

import torch

from ..errors import InvalidArgument, NotSupported
from ..figure import Figure
from .common import (as_list, asked_option, checked_index, common_tail, describe, head_labels, heading, input_length,
                     kind_of, layout_of, new_figure, numbered, on_cpu, panel_side, short_names, spans, ticks,
                     token_labels, value_of)
from .hover import Cells, hover_figure
from .scale import colour_bar, heatmap, scale_of


def _pattern(out, name: str, tokens=None, tokenizer=None, *, batch: int = 0, heads=None, image: int = 0) -> Figure:
    value = value_of(out, name)
    vision = isinstance(value, (list, tuple))
    if vision:  # the vision tower's patterns: one [heads, patches, patches] per image
        image = checked_index(image, len(value), "image")
        matrix, rows = on_cpu(value[image]), None
    else:
        batch = checked_index(batch, value.shape[0], "batch")
        matrix, rows = on_cpu(value[batch]), value.shape[0]
    count = matrix.shape[0]
    chosen = list(range(count)) if heads is None else [checked_index(h, count, "head") for h in as_list(heads, "heads")]
    queries, keys = matrix.shape[-2], matrix.shape[-1]
    labels = [str(i) for i in range(keys)] if vision and tokens is None \
        else token_labels(out, keys, tokens, batch, tokenizer)
    probabilities = name.endswith("probabilities")
    signed = name.endswith("effective_attention")  # a DeltaNet's: signed weights, nothing above the diagonal
    shown = matrix[chosen].masked_fill(~torch.isfinite(matrix[chosen]), float("nan"))
    if signed:
        shown = shown.masked_fill(torch.ones(queries, keys, dtype=torch.bool).triu(1), float("nan"))
    scale = scale_of(shown, signed=signed, colours="Blues" if probabilities else "viridis", zero=probabilities)
    columns = min(len(chosen), 4)
    lines = math.ceil(len(chosen) / columns)
    side = panel_side(keys)
    figure = new_figure(side * columns + 1.1, side * lines + 0.9)
    word = "patch" if vision else "token"
    query_labels = labels[keys - queries:] if queries <= keys else labels
    numbers = head_labels(out, name, count) if not vision else list(range(count))
    panels, cells = [], []
    for k, head in enumerate(chosen):
        axes = figure.add_subplot(lines, columns, k + 1)
        picture = heatmap(axes, shown[k], scale, aspect="equal")
        axes.set_title(f"head {numbers[head]}", fontsize=9)
        ticks(axes, labels, "x", rotate=True)
        ticks(axes, query_labels, "y")
        if k % columns == 0:
            axes.set_ylabel(f"query {word}", fontsize=8)
        axes.set_xlabel(f"key {word}", fontsize=8)
        panels.append(axes)
        cells.append(Cells(axes, shown[k], numbered("query", query_labels), numbered("key", labels),
                           name.rsplit(".", 1)[-1], f"head {numbers[head]}"))
    colour_bar(figure, picture, panels, name.rsplit(".", 1)[-1].replace("_", " "))
    figure.suptitle(heading(name, batch=batch, rows=rows, heads=[numbers[h] for h in chosen],
                            extra=f"image {image}" if vision else ""), fontsize=10)
    return hover_figure(figure, name, {"pattern": shown, "heads": chosen, "tokens": labels,
                                       "limits": (scale.low, scale.high)}, cells)


def _gates(out, name: str, tokens=None, tokenizer=None, *, batch: int = 0) -> Figure:
    value = value_of(out, name)
    batch = checked_index(batch, value.shape[0], "batch")
    grid = on_cpu(value[batch]).transpose(0, 1)  # [heads, seq]
    heads, seq = grid.shape
    labels = token_labels(out, seq, tokens, batch, tokenizer)
    numbers = head_labels(out, name, heads)
    what = name.rsplit(".", 1)[-1]
    # zero=True: a log decay of 0 keeps the whole state, the end of the decays' scale
    scale = scale_of(grid, colours="magma" if what == "decays" else "viridis", zero=True)
    figure = new_figure(min(14.0, max(4.5, 0.16 * seq + 2.0)), max(2.0, 0.28 * heads + 1.4))
    axes = figure.add_subplot()
    colour_bar(figure, heatmap(axes, grid, scale), axes, what)
    ticks(axes, labels, "x", rotate=True)
    ticks(axes, [f"head {h}" for h in numbers], "y")
    axes.set_title(describe(out, name), fontsize=8)
    figure.suptitle(heading(name, batch=batch, rows=value.shape[0], heads=numbers), fontsize=10)
    return hover_figure(figure, name, {"grid": grid, "tokens": labels, "limits": (scale.low, scale.high)},
                        [Cells(axes, grid, [f"head {h}" for h in numbers], numbered("token", labels), what)])


def _states(out, name: str, tokens=None, tokenizer=None, *, batch: int = 0, head: int = 0,
            position: int = -1) -> Figure:
    value = value_of(out, name)
    batch = checked_index(batch, value.shape[0], "batch")
    states = on_cpu(value[batch])
    over_tokens = states.dim() == 4  # [seq|positions, heads, key_dim, value_dim]; else [heads, key_dim, value_dim]
    heads = states.shape[-3]
    head = checked_index(head, heads, "head")
    names = head_labels(out, name, heads)
    figure = new_figure(11.5, max(3.6, 0.22 * heads + 1.6))
    left, right = figure.subplots(1, 2, width_ratios=[1.8, 1])
    rows = [f"head {h}" for h in names]
    if over_tokens:
        norms = states.flatten(-2).norm(dim=-1).transpose(0, 1)  # [heads, seq]
        asked, length = asked_option(out, name, "positions"), input_length(out)
        if asked is not None and len(asked) == norms.shape[1]:  # `state` at positions=[...]: each its token
            every = token_labels(out, length, tokens, batch, tokenizer) if length else None
            labels = [f"{p}: {every[p]}" if every and length and -length <= p < length else str(p) for p in asked]
        else:
            labels = token_labels(out, norms.shape[1], tokens, batch, tokenizer)
        norm_scale = scale_of(norms)
        colour_bar(figure, heatmap(left, norms, norm_scale), left, "state norm")
        ticks(left, labels, "x", rotate=True)
        ticks(left, rows, "y")
        left.set_title("each head's state norm (Frobenius) after each token", fontsize=9)
        norm_cells = Cells(left, norms, rows, numbered("after token", labels), "state norm")
        position = checked_index(position, states.shape[0], "position")
        matrix = states[position, head]
        where = f"after token {position} ({labels[position]})"
    else:
        norms = states.flatten(-2).norm(dim=-1)  # [heads]
        left.bar(range(heads), norms.numpy(), color="#4a7bd0")
        left.set_xticks(range(heads))
        left.set_xticklabels(rows, fontsize=8, rotation=90 if heads > 8 else 0)
        left.set_ylabel("state norm", fontsize=8)
        left.set_title("each head's state norm (Frobenius)", fontsize=9)
        norm_cells = Cells(left, norms[None], [""], rows, "state norm", span="columns")
        labels, matrix, where = None, states[head], ""
    scale = scale_of(matrix, signed=True)
    colour_bar(figure, heatmap(right, matrix, scale, aspect="equal"), right, "state entry")
    right.set_title(f"head {names[head]}'s state {where}".strip(), fontsize=9)
    right.tick_params(labelsize=7)
    right.set_xlabel("value dim", fontsize=8)
    right.set_ylabel("key dim", fontsize=8)
    figure.suptitle(heading(name, batch=batch, rows=value.shape[0], heads=names), fontsize=10)
    data = {"norms": norms, "matrix": matrix, "head": head, "limits": (scale.low, scale.high)}
    if over_tokens:
        data.update(position=position, tokens=labels)
    matrix_cells = Cells(right, matrix, [f"key dim {i}" for i in range(matrix.shape[0])],
                         [f"value dim {j}" for j in range(matrix.shape[1])], "state entry",
                         f"head {names[head]}, {where}".strip(", "))
    return hover_figure(figure, name, data, [norm_cells, matrix_cells])


def _residual(out, name: str, tokens=None, tokenizer=None, *, batch: int = 0) -> Figure:
    value = value_of(out, name)
    batch = checked_index(batch, value.shape[0], "batch")
    norms = on_cpu(value[batch]).norm(dim=-1)  # [seq]
    patches = kind_of(layout_of(out, name)) == "Patches"  # the vision tower's: numbered, not tokens
    labels = [str(i) for i in range(norms.shape[0])] if patches and tokens is None \
        else token_labels(out, norms.shape[0], tokens, batch, tokenizer)
    figure = new_figure(min(14.0, max(4.5, 0.16 * len(labels) + 1.5)), 3.0)
    axes = figure.add_subplot()
    axes.plot(range(len(labels)), norms.numpy(), marker="o" if len(labels) <= 48 else None, markersize=3,
              color="#4a7bd0", linewidth=1.3)
    ticks(axes, labels, "x", rotate=True)
    axes.set_xlim(-0.5, len(labels) - 0.5)
    axes.set_ylabel("norm (the y axis is its scale)", fontsize=8)
    axes.grid(alpha=0.3)
    word = "patch" if patches else "token"
    axes.set_title(f"the norm of each {word}'s vector", fontsize=8)
    figure.suptitle(heading(name, batch=batch, rows=value.shape[0]), fontsize=10)
    return hover_figure(figure, name, {"norm": norms, "tokens": labels},
                        [Cells(axes, norms[None], [""], numbered(word, labels), "norm", span="columns")])


def residual_grid(out, names: list[str], tokens=None, tokenizer=None, *, batch: int = 0) -> Figure:
    values = [value_of(out, n) for n in names]
    seqs = {tuple(v.shape[:2]) for v in values}
    if len(seqs) > 1:
        raise InvalidArgument(f"the values {', '.join(names)} differ in batch or tokens ({sorted(seqs)}): plot "
                              f"them one by one")
    batch = checked_index(batch, values[0].shape[0], "batch")
    grid = torch.stack([on_cpu(v[batch]).norm(dim=-1) for v in values])  # [values, seq]
    labels = token_labels(out, grid.shape[1], tokens, batch, tokenizer)
    rows = short_names(names)
    scale = scale_of(grid)
    figure = new_figure(min(14.0, max(4.5, 0.16 * len(labels) + 2.5)), max(2.2, 0.26 * len(names) + 1.4))
    axes = figure.add_subplot()
    colour_bar(figure, heatmap(axes, grid, scale, origin="lower"), axes, "norm")
    ticks(axes, labels, "x", rotate=True)
    ticks(axes, rows, "y")
    axes.set_title("the norm of each token's vector, block by block", fontsize=8)
    blocks = [int(found[1]) for found in (re.match(r"layers\.(\d+)\.", n) for n in names) if found]
    figure.suptitle(heading(" · ".join(common_tail(names)) or names[0], batch=batch, rows=values[0].shape[0],
                            extra=spans("block", blocks) if len(blocks) == len(names) else ""), fontsize=10)
    return hover_figure(figure, f"{len(names)} values", {"grid": grid, "names": names, "rows": rows,
                                                         "tokens": labels, "limits": (scale.low, scale.high)},
                        [Cells(axes, grid, names, numbered("token", labels), "norm")])


def _features(out, name: str, tokens=None, tokenizer=None, *, batch: int = 0, top: int = 5, rows: int = 24) -> Figure:
    value = value_of(out, name)
    layout = layout_of(out, name)
    if layout.rstrip("]").split()[-1:] == ["k"]:
        raise NotSupported(f"'{name}' ({layout}) holds a TopK SAE's k picks without the features they are: plot "
                           f"'{name.rsplit('.', 1)[0]}.features'")
    batch = checked_index(batch, value.shape[0], "batch")
    acts = on_cpu(value[batch])  # [seq, features]
    width = acts.shape[-1]
    if not isinstance(top, int) or isinstance(top, bool) or not 1 <= top <= width:
        raise InvalidArgument(f"top={top!r}: give an int in [1, {width}]")
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise InvalidArgument(f"rows={rows!r}: give a positive int (the most features drawn)")
    best = acts.topk(top, dim=-1)  # [seq, top]
    chosen = torch.unique(best.indices.flatten())
    chosen = chosen[acts[:, chosen].max(dim=0).values.argsort(descending=True)][:rows]
    grid = acts[:, chosen].transpose(0, 1)  # [features, seq]
    labels = token_labels(out, acts.shape[0], tokens, batch, tokenizer)
    unit = "neuron" if kind_of(layout) == "Neurons" else "feature"
    scale = scale_of(grid, colours="Oranges", zero=True)
    figure = new_figure(min(14.0, max(4.5, 0.16 * len(labels) + 2.2)), max(2.2, 0.2 * len(chosen) + 1.4))
    axes = figure.add_subplot()
    colour_bar(figure, heatmap(axes, grid, scale), axes, "activation")
    features = [f"{unit} {int(f)}" for f in chosen]
    ticks(axes, labels, "x", rotate=True)
    ticks(axes, features, "y")
    axes.set_title(f"each token's top {top} {unit}s ({len(chosen)} {unit}s, the most active first)", fontsize=8)
    figure.suptitle(heading(name, batch=batch, rows=value.shape[0]), fontsize=10)
    return hover_figure(figure, name, {"features": chosen, "grid": grid, "top": best.indices, "tokens": labels,
                                       "limits": (scale.low, scale.high)},
                        [Cells(axes, grid, features, numbered("token", labels), "activation")])


DRAW = {"Pattern": _pattern, "Gates": _gates, "States": _states, "State": _states, "Residual": _residual,
        "Patches": _residual, "Features": _features, "Neurons": _features}
