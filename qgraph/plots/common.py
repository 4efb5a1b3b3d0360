"""What the drawings share: the layouts' kinds, token labels, the canvas, small helpers."""
from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..errors import InvalidArgument, InvalidType, OutOfRange


KINDS = {
    "Pattern": ("attention patterns", ("batch", "heads", "image")),
    "Gates": ("DeltaNet decays and betas", ("batch",)),
    "States": ("DeltaNet states", ("batch", "head", "position")),
    "State": ("DeltaNet states", ("batch", "head", "position")),
    "Residual": ("the residual stream", ("batch",)),
    "Patches": ("the vision tower's stream", ("batch",)),
    "Features": ("SAE and transcoder features", ("batch", "top", "rows")),
    "Neurons": ("MLP neurons", ("batch", "top", "rows")),
    "Streams": ("hyper-connection streams", ("batch", "position")),
    "Injection": ("hyper-connection injection weights", ("batch", "position")),
    "Selection": ("QSA's kept keys beside the full attention", ("batch", "heads")),
}


_MAX_LABELS = 64  # token labels on one axis; past that every n-th token is labelled


def layout_of(out, name: str) -> str:
    """A captured value's layout, from what made the output (an instrumented model's catalogue, a
    loaded program's metadata); "" when unknown."""
    source = getattr(out, "source", None)
    catalogue = getattr(source, "catalogue", None)
    if isinstance(catalogue, Mapping) and name in catalogue:
        return catalogue[name].layout
    meta = getattr(source, "meta", None)
    if isinstance(meta, Mapping):
        return (meta.get("layouts") or {}).get(name, "")
    return ""


def kind_of(layout: str) -> str | None:
    kind = layout.split("[", 1)[0].strip()
    return kind if kind in KINDS else None


def checked_index(value, size: int, what: str) -> int:
    """``value`` as an index into ``size`` things (negative counts from the end)."""
    if not isinstance(value, int) or isinstance(value, bool) or not -size <= value < size:
        raise OutOfRange(f"{what}={value!r}: there are {size} (give an int in [-{size}, {size}))")
    return value % size


def value_of(out, name: str) -> torch.Tensor:
    return out.values[name]


def on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().float().cpu()


def asked_option(out, name: str, key: str):
    """A value's option as it was asked (``values={name: {"heads": [...]}}``), if the source knows it."""
    options = getattr(getattr(out, "source", None), "options", None)
    return (options.get(name) or {}).get(key) if isinstance(options, Mapping) else None


# -- token labels ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _tokenizer_at(path: str):
    """The tokenizer saved with a model: in its folder, or in the Hugging Face cache; never fetched."""
    try:
        folder = Path(path)
        if folder.is_dir() and not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # no tokenizer there (or one that does not load): the labels are the ids
        return None


def tokenizer_of(source):
    """The tokenizer of the model behind ``source`` (an instrumented model or a loaded program), or None."""
    config = getattr(source, "config", None)
    path = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    return _tokenizer_at(str(path)) if path else None


def decode(ids, tokenizer) -> list[str]:
    """Each id as its token's text (escapes shown, ``\\n`` for a newline), or as the id without a tokenizer."""
    ids = [int(i) for i in ids]
    if tokenizer is None:
        return [str(i) for i in ids]
    shown = [repr(tokenizer.decode([i]))[1:-1] for i in ids]
    return [text if text.strip() else "␣" * len(text) or "∅" for text in shown]  # a space shows as ␣


def token_labels(out, seq: int, tokens, batch: int, tokenizer=None) -> list[str]:
    """The labels of a value's ``seq`` token positions: ``tokens`` as given, else the call's tokens decoded by
    ``tokenizer`` (default: the model's own, where its folder or the Hugging Face cache has it), else numbers."""
    if tokens is not None:
        if isinstance(tokens, str) or not isinstance(tokens, Sequence):
            raise InvalidType(f"tokens= takes a list of strings (one per token), not {type(tokens).__name__}")
        rows = list(tokens)
        if rows and not isinstance(rows[0], str) and isinstance(rows[0], Sequence):  # one list per batch row
            rows = list(rows[checked_index(batch, len(rows), "batch")])
        if len(rows) != seq:
            raise InvalidArgument(f"tokens= has {len(rows)} labels for {seq} token positions: give one per token")
        return [str(t) for t in rows]
    ids = getattr(out, "input_ids", None)
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == seq and batch < ids.shape[0]:
        return decode(ids[batch].tolist(), tokenizer or tokenizer_of(getattr(out, "source", None)))
    return [str(i) for i in range(seq)]


def ticks(axis, labels: list[str], which: str, rotate: bool = False) -> None:
    """Label an axis with ``labels``, at most ``_MAX_LABELS`` of them (every n-th past that)."""
    step = max(1, math.ceil(len(labels) / _MAX_LABELS))
    at = list(range(0, len(labels), step))
    size = 8 if len(at) <= 40 else 6
    kwargs = dict(fontsize=size, parse_math=False)
    if which == "x":
        axis.set_xticks(at)
        axis.set_xticklabels([labels[i] for i in at], rotation=90 if rotate else 0, **kwargs)
    else:
        axis.set_yticks(at)
        axis.set_yticklabels([labels[i] for i in at], **kwargs)


def new_figure(width: float, height: float):
    """A matplotlib figure on an Agg canvas (no pyplot, no GUI)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as Drawing
    figure = Drawing(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def panel_side(seq: int) -> float:
    """The side of a token × token panel, in inches."""
    return min(4.5, max(2.4, 0.13 * seq))


def heading(name: str, *, batch: int | None = None, rows: int | None = None, heads=None, extra: str = "") -> str:
    """A figure's title: the value's name, its block, the heads drawn, ``extra``, and the batch row (when the
    call had several)."""
    parts = [name]
    block = re.match(r"(vision\.)?layers\.(\d+)\.", name)
    if block:
        parts.append(f"{'vision ' if block[1] else ''}block {block[2]}")
    if heads is not None:
        parts.append(spans("head", list(heads)))
    if extra:
        parts.append(extra)
    if batch is not None and rows and rows > 1:
        parts.append(f"batch {batch}")
    return "  ·  ".join(parts)


def spans(what: str, numbers: list[int]) -> str:
    """``heads 0–3``, ``head 2``, ``heads 3, 1``: numbers as a reader says them."""
    if len(numbers) == 1:
        return f"{what} {numbers[0]}"
    if len(numbers) > 2 and numbers == list(range(numbers[0], numbers[0] + len(numbers))):
        return f"{what}s {numbers[0]}–{numbers[-1]}"
    return f"{what}s {', '.join(map(str, numbers))}"


def input_length(out) -> int | None:
    ids = getattr(out, "input_ids", None)
    return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


# -- small helpers --------------------------------------------------------------------------------------


def as_list(value, what: str) -> list:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple, range)):
        return list(value)
    raise InvalidType(f"{what}= takes an int or a list of ints, not {type(value).__name__}")


def head_labels(out, name: str, heads: int) -> list[int]:
    """The heads' numbers in the model (a value asked with ``heads=[...]`` holds only those)."""
    asked = asked_option(out, name, "heads")
    return list(asked) if asked is not None and len(asked) == heads else list(range(heads))


def describe(out, name: str) -> str:
    catalogue = getattr(getattr(out, "source", None), "catalogue", None)
    entry = catalogue.get(name) if isinstance(catalogue, Mapping) else None
    return getattr(entry, "description", "") or ""


def common_tail(names: list[str]) -> list[str]:
    """The dotted parts every name shares at the same place from the end (``layer_output``)."""
    parts = [n.split(".") for n in names]
    shared = []
    for column in zip(*(reversed(p) for p in parts)):
        if len(set(column)) > 1:
            break
        shared.append(column[0])
    return ["*." + ".".join(reversed(shared))] if shared else []


def short_names(names: list[str]) -> list[str]:
    """Each name without the dotted tail all share (``layers.3`` for ``layers.3.layer_output``)."""
    tail = common_tail(names)
    cut = len(tail[0]) - 1 if tail else 0
    short = [n[:-cut] if cut and len(n) > cut else n for n in names]
    return short if len(set(short)) == len(short) else names


def numbered(word: str, labels: list[str]) -> list[str]:
    """Each label as a hover names it: ``query 3: c`` (``word``, its index, its text)."""
    return [f"{word} {i}: {label}" for i, label in enumerate(labels)]
