"""Common interventions built on edits: steering, skipping blocks, activation patching."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Callable

import torch

from .edits import _AXES, Add, Replace, Zero
from .errors import InvalidArgument, InvalidType

# the axes attribution keeps: one estimate per batch row, position and head
_KEPT_AXES = {*_AXES["batch"], *_AXES["positions"], *_AXES["heads"]}


def steer(layers: int | Iterable[int], vector: torch.Tensor, factor: float = 1.0,
          positions: Iterable[int] | None = None) -> dict:
    """The edits that add ``factor * vector`` to ``layer_output`` of ``layers`` (at ``positions``,
    or every position). Use as ``instrument(..., edits=steer(...))`` or per call ``ig(..., edits=...)``."""
    layers = [layers] if isinstance(layers, int) else layers
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable) \
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise InvalidType(f"steer takes a block index or a list of them, not {layers!r}: e.g. steer([2, 3], vector)")
    positions = None if positions is None else list(positions)
    return {f"layers.{i}.layer_output": Add(vector, scale=factor, positions=positions) for i in layers}


def skip_layers(start: int, end: int) -> dict:
    """The edits that make blocks ``start..end`` (inclusive) pass their input through, so that
    ``layers.{end}.layer_output == layers.{start}.layer_input``: each block's mixer and MLP add zero."""
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in (start, end)) or not 0 <= start <= end:
        raise InvalidArgument(f"skip_layers(start, end) takes block indices with 0 <= start <= end (both skipped), "
                              f"not ({start!r}, {end!r})")
    edits = {}
    for i in range(start, end + 1):
        edits[f"layers.{i}.*.attention_output"] = Zero()  # whichever mixer the block has
        edits[f"layers.{i}.mlp.mlp_output"] = Zero()
    return edits


def patch(instrumented, clean, corrupt, at, metric: Callable[[torch.Tensor], object]) -> dict:
    """Activation patching: capture ``at`` on the ``clean`` input, then splice each location, one
    at a time, into a run on ``corrupt``; return ``{location: metric(patched logits)}``.

    ``clean`` and ``corrupt`` are input_ids tensors or dicts of model inputs of the same shape;
    ``at`` takes names and globs like ``values=``. Both runs are ``instrumented``'s own: its fixed
    edits and SAEs in place (so ``at`` may name SAE features).
    """
    clean, corrupt = _pair(clean, corrupt, metric)
    names = instrumented.resolve(at)
    patcher = instrumented.variant(names, edits=names)
    with torch.no_grad():
        captured = patcher(**clean).values
        return {name: metric(patcher(**corrupt, edits={name: Replace(captured[name])}).logits) for name in names}


def attribution_patch(instrumented, clean, corrupt, at, metric: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """Attribution patching: the first-order estimate of what ``patch`` measures, from one forward
    on ``clean`` and one forward and backward on ``corrupt``.

    For each value at ``at``: ``(clean - corrupt) * d metric / d value`` (the gradient at the corrupt
    run), summed over every axis but the batch, position and head axes of its layout, so
    ``{name: tensor [batch, seq]}`` (``[batch, seq, heads]`` where the layout has heads; a pattern keeps
    its query axis). The sum of a name's tensor estimates ``metric(patched) - metric(corrupt)`` for
    splicing the whole value, as ``patch`` does. ``metric(logits)`` must return a scalar tensor;
    the model's parameters get no ``.grad``. Both runs are ``instrumented``'s own (fixed edits, SAEs).
    """
    clean, corrupt = _pair(clean, corrupt, metric)
    names = instrumented.resolve(at)
    watcher = instrumented.variant({name: {"grad": True} for name in names})
    with torch.no_grad():
        clean_values = watcher(**clean).values
    with torch.enable_grad():
        out = watcher(**corrupt)
        score = metric(out.logits)
        if not isinstance(score, torch.Tensor) or score.numel() != 1:
            raise InvalidArgument(f"attribution_patch needs metric(logits) to return a scalar tensor to differentiate, "
                                  f"got {type(score).__name__}{tuple(score.shape) if isinstance(score, torch.Tensor) else ''}")
        grads = out.gradients(score.reshape(()), names)
    attributions = {}
    for name in names:
        entry = watcher.catalogue[name]
        dims = [str(d) for d in (entry.spec.dims if entry.spec else entry.shape)]
        effect = (clean_values[name] - out.values[name].detach()) * grads[name]
        summed = [axis for axis, dim in enumerate(dims) if dim not in _KEPT_AXES]
        attributions[name] = effect.sum(dim=summed) if summed else effect
    return attributions


def _pair(clean, corrupt, metric) -> tuple[dict, dict]:
    """The clean and corrupt inputs as dicts, checked to be comparable position by position."""
    if not callable(metric):
        raise InvalidType(f"metric must be a function of the logits, e.g. lambda logits: logits[:, -1, token].sum(); "
                          f"got {metric!r}")
    clean, corrupt = _inputs(clean), _inputs(corrupt)
    shapes = [tuple(getattr(x.get("input_ids"), "shape", ())) for x in (clean, corrupt)]
    if shapes[0] != shapes[1]:
        raise InvalidArgument(f"clean {shapes[0]} and corrupt {shapes[1]} inputs must have the same shape to compare "
                              f"them position by position")
    return clean, corrupt


def _inputs(inputs) -> dict:
    return dict(inputs) if isinstance(inputs, Mapping) else {"input_ids": inputs}


def expert_neurons(out, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``expert``'s neurons in block ``layer`` of a MoE model, only at the tokens routed to it:
    ``(tokens [n, 2], neurons [n, expert_intermediate_size])``, each token as its ``(batch, seq)``
    index. ``out`` is a call that captured ``layers.{layer}.mlp.experts_neurons`` and ``router_indices``."""
    neurons, indices = (out[f"layers.{layer}.mlp.{name}"] for name in ("experts_neurons", "router_indices"))
    routed = indices == expert  # [batch seq top_k]: a token picks an expert at most once
    return routed.any(-1).nonzero(), neurons[routed]
