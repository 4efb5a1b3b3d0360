"""Common interventions built on edits: steering, skipping blocks, activation patching."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Callable

import torch

from .edits import Add, Replace, Zero


def steer(layers: int | Iterable[int], vector: torch.Tensor, factor: float = 1.0,
          positions: Iterable[int] | None = None) -> dict:
    """The edits that add ``factor * vector`` to ``layer_output`` of ``layers`` (at ``positions``,
    or every position). Use as ``instrument(..., edits=steer(...))`` or per call ``ig(..., edits=...)``."""
    layers = [layers] if isinstance(layers, int) else list(layers)
    positions = None if positions is None else list(positions)
    return {f"layers.{i}.layer_output": Add(vector, scale=factor, positions=positions) for i in layers}


def skip_layers(start: int, end: int) -> dict:
    """The edits that make blocks ``start..end`` (inclusive) pass their input through, so that
    ``layers.{end}.layer_output == layers.{start}.layer_input``: each block's mixer and MLP add zero."""
    edits = {}
    for i in range(start, end + 1):
        edits[f"layers.{i}.*.attention_output"] = Zero()  # whichever mixer the block has
        edits[f"layers.{i}.mlp.mlp_output"] = Zero()
    return edits


def patch(instrumented, clean, corrupt, at, metric: Callable[[torch.Tensor], object]) -> dict:
    """Activation patching: capture ``at`` on the ``clean`` input, then splice each location, one
    at a time, into a run on ``corrupt``; return ``{location: metric(patched logits)}``.

    ``clean`` and ``corrupt`` are input_ids tensors or dicts of model inputs of the same shape;
    ``at`` takes names and globs like ``values=``.
    """
    from .instrument import instrument
    clean, corrupt = _inputs(clean), _inputs(corrupt)
    if clean["input_ids"].shape != corrupt["input_ids"].shape:
        raise ValueError(f"clean {tuple(clean['input_ids'].shape)} and corrupt {tuple(corrupt['input_ids'].shape)} "
                         f"inputs must have the same shape to patch position by position")
    names = instrumented._resolve(at)
    patcher = instrument(instrumented.model, values=names, edits=names)
    captured = patcher(**clean).values
    return {name: metric(patcher(**corrupt, edits={name: Replace(captured[name])}).logits) for name in names}


def _inputs(inputs) -> dict:
    return dict(inputs) if isinstance(inputs, Mapping) else {"input_ids": inputs}
