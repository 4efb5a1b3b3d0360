"""One drawing per layout kind (``DRAW``), and the logit lens's grid."""
from __future__ import annotations

import math

import torch

from ..errors import InvalidArgument, NotSupported
from ..figure import Figure
from .common import (kind_of, layout_of, as_list, asked_option, checked_index, common_tail, decode, describe,
                     head_labels, input_length, new_figure, on_cpu, panel_side, short_names, ticks, title, token_labels,
                     tokenizer_of, value_of)


# -- drawing --------------------------------------------------------------------------------------------


def _pattern(out, name: str, tokens=None, *, batch: int = 0, heads=None, image: int = 0) -> Figure:
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
    labels = [str(i) for i in range(keys)] if vision and tokens is None else token_labels(out, keys, tokens, batch)
    probabilities = name.endswith("probabilities")
    signed = name.endswith("effective_attention")  # a DeltaNet's: signed weights, nothing above the diagonal
    shown = matrix[chosen].masked_fill(~torch.isfinite(matrix[chosen]), float("nan"))
    if signed:
        shown = shown.masked_fill(torch.ones(queries, keys, dtype=torch.bool).triu(1), float("nan"))
    finite = shown[~torch.isnan(shown)]
    low = 0.0 if probabilities else (float(finite.min()) if finite.numel() else 0.0)
    high = float(finite.max()) if finite.numel() else 1.0
    if signed:  # centred on zero: red reads the value, blue reads its negative
        high = max(abs(low), abs(high)) or 1.0
        low = -high
    columns = min(len(chosen), 4)
    lines = math.ceil(len(chosen) / columns)
    side = panel_side(keys)
    figure = new_figure(side * columns + 0.6, side * lines + 0.9)
    import matplotlib
    colours = matplotlib.colormaps["Blues" if probabilities else "RdBu_r" if signed else "viridis"].with_extremes(
        bad="#ffffff")  # masked: blank
    for k, head in enumerate(chosen):
        axes = figure.add_subplot(lines, columns, k + 1)
        axes.imshow(shown[k].numpy(), cmap=colours, vmin=low, vmax=high if high > low else low + 1,
                    interpolation="nearest", aspect="equal")
        axes.set_title(f"head {head}", fontsize=9)
        ticks(axes, labels, "x", rotate=True)
        ticks(axes, labels[keys - queries:] if queries <= keys else labels, "y")
        if k % columns == 0:
            axes.set_ylabel("query", fontsize=8)
        axes.set_xlabel("key", fontsize=8)
    where = f"image {image}" if vision else None
    figure.suptitle(title(name, batch, rows) + (f"  ·  {where}" if where else ""), fontsize=10)
    return Figure.from_matplotlib(figure, name, {"pattern": shown, "heads": chosen, "tokens": labels})


def _gates(out, name: str, tokens=None, *, batch: int = 0) -> Figure:
    value = value_of(out, name)
    batch = checked_index(batch, value.shape[0], "batch")
    grid = on_cpu(value[batch]).transpose(0, 1)  # [heads, seq]
    heads, seq = grid.shape
    labels = token_labels(out, seq, tokens, batch)
    figure = new_figure(min(14.0, max(4.0, 0.16 * seq + 1.6)), max(1.8, 0.28 * heads + 1.3))
    axes = figure.add_subplot()
    picture = axes.imshow(grid.numpy(), cmap="magma" if name.endswith("decays") else "viridis", aspect="auto",
                          interpolation="nearest")
    figure.colorbar(picture, ax=axes, shrink=0.9).set_label(name.rsplit(".", 1)[-1], fontsize=8)
    ticks(axes, labels, "x", rotate=True)
    ticks(axes, [f"head {h}" for h in head_labels(out, name, heads)], "y")
    axes.set_title(describe(out, name), fontsize=8)
    figure.suptitle(title(name, batch, value.shape[0]), fontsize=10)
    return Figure.from_matplotlib(figure, name, {"grid": grid, "tokens": labels})


def _states(out, name: str, tokens=None, *, batch: int = 0, head: int = 0, position: int = -1) -> Figure:
    value = value_of(out, name)
    batch = checked_index(batch, value.shape[0], "batch")
    states = on_cpu(value[batch])
    over_tokens = states.dim() == 4  # [seq|positions, heads, key_dim, value_dim]; else [heads, key_dim, value_dim]
    heads = states.shape[-3]
    head = checked_index(head, heads, "head")
    names = head_labels(out, name, heads)
    figure = new_figure(10.5, 3.6)
    left, right = figure.subplots(1, 2, width_ratios=[1.8, 1])
    if over_tokens:
        norms = states.flatten(-2).norm(dim=-1).transpose(0, 1)  # [heads, seq]
        asked, length = asked_option(out, name, "positions"), input_length(out)
        if asked is not None and len(asked) == norms.shape[1]:  # `state` at positions=[...]: each its token
            every = token_labels(out, length, tokens, batch) if length else None
            labels = [f"{p}: {every[p]}" if every and length and -length <= p < length else str(p) for p in asked]
        else:
            labels = token_labels(out, norms.shape[1], tokens, batch)
        for h in range(heads):
            left.plot(range(norms.shape[1]), norms[h].numpy(), marker="o" if norms.shape[1] <= 32 else None,
                      markersize=3, linewidth=1.2, label=f"head {names[h]}")
        ticks(left, labels, "x", rotate=True)
        left.set_ylabel("state norm", fontsize=8)
        position = checked_index(position, states.shape[0], "position")
        matrix = states[position, head]
        where = f"after token {position} ({labels[position]})"
    else:
        norms = states.flatten(-2).norm(dim=-1)  # [heads]
        left.bar(range(heads), norms.numpy(), color="#4a7bd0")
        left.set_xticks(range(heads))
        left.set_xticklabels([f"head {h}" for h in names], fontsize=8)
        left.set_ylabel("state norm", fontsize=8)
        labels, matrix, where = None, states[head], ""
    left.set_title("each head's state norm (Frobenius)", fontsize=9)
    if heads <= 12 and over_tokens:
        left.legend(fontsize=7, ncols=2 if heads > 6 else 1)
    bound = float(matrix.abs().max()) or 1.0
    picture = right.imshow(matrix.numpy(), cmap="RdBu_r", vmin=-bound, vmax=bound, interpolation="nearest")
    figure.colorbar(picture, ax=right, shrink=0.85)
    right.set_title(f"head {names[head]}'s state {where}".strip(), fontsize=9)
    right.set_xlabel("value dim", fontsize=8)
    right.set_ylabel("key dim", fontsize=8)
    figure.suptitle(title(name, batch, value.shape[0]), fontsize=10)
    data = {"norms": norms, "matrix": matrix, "head": head}
    if over_tokens:
        data.update(position=position, tokens=labels)
    return Figure.from_matplotlib(figure, name, data)


def _residual(out, name: str, tokens=None, *, batch: int = 0) -> Figure:
    value = value_of(out, name)
    batch = checked_index(batch, value.shape[0], "batch")
    norms = on_cpu(value[batch]).norm(dim=-1)  # [seq]
    patches = kind_of(layout_of(out, name)) == "Patches"  # the vision tower's: numbered, not tokens
    labels = [str(i) for i in range(norms.shape[0])] if patches and tokens is None \
        else token_labels(out, norms.shape[0], tokens, batch)
    figure = new_figure(min(14.0, max(4.5, 0.16 * len(labels) + 1.5)), 3.0)
    axes = figure.add_subplot()
    axes.plot(range(len(labels)), norms.numpy(), marker="o" if len(labels) <= 48 else None, markersize=3,
              color="#4a7bd0", linewidth=1.3)
    ticks(axes, labels, "x", rotate=True)
    axes.set_ylabel("norm", fontsize=8)
    axes.grid(alpha=0.3)
    axes.set_title(f"the norm of each {'patch' if patches else 'token'}'s vector", fontsize=8)
    figure.suptitle(title(name, batch, value.shape[0]), fontsize=10)
    return Figure.from_matplotlib(figure, name, {"norm": norms, "tokens": labels})


def residual_grid(out, names: list[str], tokens=None, *, batch: int = 0) -> Figure:
    values = [value_of(out, n) for n in names]
    seqs = {tuple(v.shape[:2]) for v in values}
    if len(seqs) > 1:
        raise InvalidArgument(f"the values {', '.join(names)} differ in batch or tokens ({sorted(seqs)}): plot "
                              f"them one by one")
    batch = checked_index(batch, values[0].shape[0], "batch")
    grid = torch.stack([on_cpu(v[batch]).norm(dim=-1) for v in values])  # [values, seq]
    labels = token_labels(out, grid.shape[1], tokens, batch)
    rows = short_names(names)
    figure = new_figure(min(14.0, max(4.5, 0.16 * len(labels) + 2.5)), max(2.2, 0.26 * len(names) + 1.4))
    axes = figure.add_subplot()
    picture = axes.imshow(grid.numpy(), cmap="viridis", aspect="auto", interpolation="nearest", origin="lower")
    figure.colorbar(picture, ax=axes, shrink=0.9).set_label("norm", fontsize=8)
    ticks(axes, labels, "x", rotate=True)
    ticks(axes, rows, "y")
    axes.set_title("the norm of each token's vector, block by block", fontsize=8)
    figure.suptitle(title(" · ".join(common_tail(names)) or names[0], batch, values[0].shape[0]), fontsize=10)
    return Figure.from_matplotlib(figure, f"{len(names)} values", {"grid": grid, "names": names, "rows": rows,
                                                                   "tokens": labels})


def _features(out, name: str, tokens=None, *, batch: int = 0, top: int = 5, rows: int = 24) -> Figure:
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
    labels = token_labels(out, acts.shape[0], tokens, batch)
    unit = "neuron" if kind_of(layout) == "Neurons" else "feature"
    figure = new_figure(min(14.0, max(4.5, 0.16 * len(labels) + 2.2)), max(2.2, 0.2 * len(chosen) + 1.4))
    axes = figure.add_subplot()
    picture = axes.imshow(grid.numpy(), cmap="Oranges", aspect="auto", interpolation="nearest")
    figure.colorbar(picture, ax=axes, shrink=0.9).set_label("activation", fontsize=8)
    ticks(axes, labels, "x", rotate=True)
    ticks(axes, [f"{unit} {int(f)}" for f in chosen], "y")
    axes.set_title(f"each token's top {top} {unit}s ({len(chosen)} {unit}s, the most active first)", fontsize=8)
    figure.suptitle(title(name, batch, value.shape[0]), fontsize=10)
    return Figure.from_matplotlib(figure, name, {"features": chosen, "grid": grid, "top": best.indices,
                                                 "tokens": labels})


DRAW = {"Pattern": _pattern, "Gates": _gates, "States": _states, "State": _states, "Residual": _residual,
         "Patches": _residual, "Features": _features, "Neurons": _features}


# -- the logit lens -------------------------------------------------------------------------------------


_LENS_TEXT = 64  # positions past which the cells are too narrow for their tokens


def lens_figure(lens, tokenizer=None, batch: int = 0, tokens=None) -> Figure:
    """``LogitLens.plot``: blocks (up) × positions (across), each cell the block's top token there, coloured
    by its probability (the scale from 0 to the grid's largest, shown in the colour bar); the x axis the
    input's token at each position (the lens reads the next one). A left-padded row's pads are not drawn
    (the lens holds them); past ``_LENS_TEXT`` positions the cells hold no text (too narrow)."""
    if not lens:
        raise InvalidArgument("the logit lens is empty: nothing to draw")
    if tokenizer is None:
        tokenizer = tokenizer_of(getattr(lens, "_source", None))
    batch = checked_index(batch, lens.top_ids.shape[0], "batch")
    mask = lens.attention_mask
    real = [k for k, p in enumerate(lens.positions) if mask is None or bool(mask[batch, p])]
    if not real:
        raise InvalidArgument(f"row {batch}'s positions {lens.positions} are all padding: nothing to draw")
    ids = lens.top_ids[batch, :, real, 0].cpu()  # [blocks, positions]: each cell's top-1
    probabilities = on_cpu(lens.top_probs[batch, :, real, 0])
    positions = [lens.positions[k] for k in real]
    blocks, cells = list(range(ids.shape[0])), [decode(row.tolist(), tokenizer) for row in ids]
    if tokens is not None:
        labels = [str(t) for t in tokens]
        if len(labels) != len(positions):
            raise InvalidArgument(f"tokens= has {len(labels)} labels for {len(positions)} positions"
                                  + (" (its row's real ones: pads are not drawn)" if mask is not None else ""))
    else:
        words = decode(lens.input_ids[batch, positions].tolist(), tokenizer)
        whole = positions == list(range(positions[0], positions[0] + len(positions)))  # the tokens alone say it
        labels = [w if whole else f"{p}: {w}" for p, w in zip(positions, words)]
    text = len(positions) <= _LENS_TEXT
    figure = new_figure(min(28.0, max(4.0, (0.42 if text else 0.16) * len(positions) + 2.4)),
                        max(2.6, 0.3 * len(blocks) + 1.7))
    axes = figure.add_subplot()
    high = max(float(probabilities.max()), 1e-6)
    picture = axes.imshow(probabilities.numpy(), cmap="Blues", vmin=0, vmax=high, aspect="auto", origin="lower",
                          interpolation="nearest")
    figure.colorbar(picture, ax=axes, shrink=0.9, pad=0.01).set_label("top-1 probability", fontsize=8)
    if text:
        size = 7 if len(positions) <= 24 else 5.5
        for b in blocks:
            for k, cell in enumerate(cells[b]):
                axes.text(k, b, cell if len(cell) <= 6 else cell[:5] + "…", ha="center", va="center", fontsize=size,
                          parse_math=False, color="white" if probabilities[b, k] > 0.6 * high else "black")
    ticks(axes, labels, "x", rotate=len(positions) > 8)
    ticks(axes, [f"block {b}" for b in blocks], "y")
    axes.set_xlabel("input token (each cell: the block's top guess at the next)", fontsize=8)
    figure.suptitle("logit lens: each block's top token" + (f"  ·  batch {batch}" if batch else ""), fontsize=10)
    return Figure.from_matplotlib(figure, "logit lens", {"tokens": cells, "ids": ids, "probabilities": probabilities,
                                                         "positions": positions, "labels": labels})
