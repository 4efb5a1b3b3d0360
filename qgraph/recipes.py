"""Common interventions built on edits: steering, skipping blocks, activation patching."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from .edits import AXES, Add, Zero
from .errors import InvalidArgument, InvalidType
from .plots.patching import patching_figure


class PatchResult(dict):
    """What ``patch`` and ``attribution_patch`` return: ``{name: metric values}`` (a dict, as it always
    was), with what its picture needs: ``positions`` and ``heads`` as asked, the clean input's
    ``input_ids`` and the instrument (``source``) whose tokenizer labels them. ``plot()`` draws it."""

    def __init__(self, results: dict, *, title: str, what: str, positions, heads, input_ids, source):
        super().__init__(results)
        self.title, self.what, self.positions, self.heads = title, what, positions, heads
        self.input_ids, self.source = input_ids, source

    def plot(self, *, tokens=None, tokenizer=None):
        """A ``qgraph.Figure``: each value's metric at each location, diverging at zero (values × positions
        or heads; one panel per value, heads × positions, for both; ``qgraph/plots/patching.py``).
        ``tokens`` labels the positions, else the clean input decoded by ``tokenizer`` (default: the
        model's own, where its folder has one)."""
        return patching_figure(self, tokens, tokenizer)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{name}: {tuple(getattr(value, 'shape', ()))}" for name, value in self.items())
        return f"PatchResult({self.title}; {shapes}; .plot())"


def steer(layers: int | Iterable[int], vector: torch.Tensor, factor: float = 1.0,
          positions: Iterable[int] | None = None, relative: bool = False) -> dict:
    """The edits that add ``factor * vector`` to ``layer_output`` of ``layers`` (at ``positions``,
    or every position). ``relative=True`` scales the vector by each row's mean residual norm over its
    real (unpadded) tokens too (``Add(..., relative=True)``): nnsight's inline
    ``x + factor * x.norm(dim=-1, keepdim=True).mean() * vector`` on one prompt, as data. Use as
    ``instrument(..., edits=steer(...))`` or per call ``ig(..., edits=...)``."""
    layers = [layers] if isinstance(layers, int) else layers
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable) \
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise InvalidType(f"steer takes a block index or a list of them, not {layers!r}: e.g. steer([2, 3], vector)")
    positions = None if positions is None else list(positions)
    return {f"layers.{i}.layer_output": Add(vector, scale=factor, positions=positions, relative=relative)
            for i in layers}


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


def patch(instrumented, clean, corrupt, at, metric: Callable[[torch.Tensor], object], *, positions=None,
          heads=None, batch_size: int | None = None) -> dict:
    """Activation patching: capture ``at`` on the ``clean`` input, then splice it, one location at a
    time, into a run on ``corrupt``; return ``{name: metric(patched logits)}``.

    A location is the whole value (``positions=None, heads=None``: the value is ``metric``'s result
    itself), or each position (``positions="each"``, or a list of positions) and/or each head
    (``heads="each"`` or a list, on values with a heads axis): then the value is a tensor of metric
    results, ``[positions]``, ``[heads]`` or ``[positions, heads]``, and ``metric`` must return a number.
    ``clean`` and ``corrupt`` are input_ids tensors or dicts of model inputs of the same shape; ``at``
    takes names and globs like ``values=``. Both runs are ``instrumented``'s own: its fixed edits and
    SAEs in place (so ``at`` may name SAE features).

    The corrupt run goes once; each location runs only the blocks from its value's on, and the
    locations of a value run together, ``batch_size`` of them per pass (default: as many as keep the
    logits of a pass under 512 MiB), stacked along the batch (``qgraph.sweep``). The result is a
    ``PatchResult`` (a dict) whose ``plot()`` draws values × locations.
    """
    clean, corrupt = _pair(clean, corrupt, metric)
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise InvalidArgument(f"batch_size= takes a positive int (locations per pass), not {batch_size!r}")
    results = instrumented.run_patches(clean, corrupt, instrumented.resolve(at), metric, positions, heads, batch_size)
    return PatchResult(results, title="activation patching", what="metric after patching", positions=positions,
                       heads=heads, input_ids=clean.get("input_ids"), source=instrumented)


def attribution_patch(instrumented, clean, corrupt, at, metric: Callable[[torch.Tensor], torch.Tensor], *,
                      positions=None, heads=None) -> dict:
    """Attribution patching: the first-order estimate of what ``patch`` measures, from one forward
    on ``clean`` and one forward and backward on ``corrupt``.

    For each value at ``at`` and each location (as ``patch`` takes them: the whole value, or
    ``positions="each"`` / a list, ``heads="each"`` / a list): ``(clean - corrupt) * d metric / d value``
    (the gradient at the corrupt run) summed over the location, which estimates
    ``metric(patched) - metric(corrupt)`` for that location. ``{name: tensor}``, shaped as ``patch``'s
    values: ``[]``, ``[positions]``, ``[heads]`` or ``[positions, heads]`` (a pattern's positions are
    its queries). ``metric(logits)`` must return a scalar tensor; the model's parameters get no
    ``.grad``. Both runs are ``instrumented``'s own (fixed edits, SAEs). A ``PatchResult``, as ``patch``'s.
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
            shape = tuple(score.shape) if isinstance(score, torch.Tensor) else ""
            raise InvalidArgument(f"attribution_patch needs metric(logits) to return a scalar tensor to differentiate, "
                                  f"got {type(score).__name__}{shape}")
        grads = out.gradients(score.reshape(()), names)
    attributions = {}
    for name in names:
        entry = watcher.catalogue[name]
        dims = list(entry.dims)
        effect = ((clean_values[name] - out.values[name].detach()) * grads[name]).detach()
        attributions[name] = _by_location(effect, dims, name, positions, heads)
    return PatchResult(attributions, title="attribution patching", what="estimated metric change",
                       positions=positions, heads=heads, input_ids=clean.get("input_ids"), source=instrumented)


def _by_location(effect: torch.Tensor, dims: list[str], name: str, positions, heads) -> torch.Tensor:
    """``effect`` summed over each location: over every axis but those of the positions and heads
    asked for, then those indexed as asked, positions first (``patch``'s shapes)."""
    from .sweep import axis_of, locations  # lazy: keeps tqdm out until this is used
    kept = {}  # axis -> the indices asked along it, in the order positions, heads
    for what, given in (("positions", positions), ("heads", heads)):
        axis = axis_of(dims, what)
        if given is None:
            continue
        if axis is None:
            raise InvalidArgument(f"attribution_patch({what}={given!r}) at '{name}': its layout has no "
                                  f"{'/'.join(AXES[what])} axis; leave {what}=None to take the whole value")
        kept[axis] = locations(given, effect.shape[axis], what, name)
    others = [axis for axis in range(effect.dim()) if axis not in kept]
    summed = effect.sum(dim=others) if others else effect  # the kept axes stay, in the layout's order
    for rank, axis in enumerate(sorted(kept)):
        summed = summed.index_select(rank, torch.tensor(kept[axis], device=summed.device))
    return summed.permute([sorted(kept).index(axis) for axis in kept])


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
