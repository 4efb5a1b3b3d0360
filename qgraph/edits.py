"""Edits: what to do to a value. An edit is applied where the value lives in the graph, so every
value read downstream of it sees the edited tensor (and the value itself is captured as edited).

Each tensor edit can select a region by the value's layout axes: ``batch=``, ``positions=`` (the
``seq`` axis, the ``query`` axis of a pattern, the rows of a vision value), ``heads=`` (any heads axis) and ``neurons=``
(an ``intermediate_size`` axis). A selection is a list of indices (negative ones count from the
end). Any callable ``f(tensor) -> tensor`` is an edit too; it sees and returns the whole value.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

# Which layout dims each selector addresses, in order of preference.
_AXES = {
    "batch": ("batch",),
    "positions": ("seq", "query", "image_tokens", "patches"),
    "heads": ("num_heads", "num_kv_heads", "key_heads", "value_heads", "heads"),
    "neurons": ("intermediate_size",),
}


class EditError(ValueError):
    """An edit that does not fit the value it is applied to; the message names the value and its layout."""


@dataclass(frozen=True)
class Target:
    """Where an edit lands: the value's name, its layout and the dims of that layout."""

    name: str
    layout: str
    dims: tuple

    def describe(self) -> str:
        return f"'{self.name}' ({self.layout})" if self.layout else f"'{self.name}'"


@dataclass
class Edit:
    """Base of the tensor edits: the region selection shared by all of them."""

    batch: Sequence[int] | None = field(default=None, kw_only=True)
    positions: Sequence[int] | None = field(default=None, kw_only=True)
    heads: Sequence[int] | None = field(default=None, kw_only=True)
    neurons: Sequence[int] | None = field(default=None, kw_only=True)

    def apply(self, x: torch.Tensor, target: Target) -> torch.Tensor:
        index = self._region(x, target)
        out = x.clone()
        out[index] = self.change(x[index], target, index)
        return out

    def change(self, region: torch.Tensor, target: Target, index) -> torch.Tensor:
        raise NotImplementedError

    def _region(self, x: torch.Tensor, target: Target):
        """An open-mesh index of the selected region: one broadcastable index tensor per axis."""
        index = [torch.arange(size, device=x.device) for size in x.shape]
        for selector, dims in _AXES.items():
            chosen = getattr(self, selector)
            if chosen is None:
                continue
            axis = next((target.dims.index(d) for d in dims if d in target.dims), None)
            if axis is None:
                raise EditError(f"{type(self).__name__}({selector}=...) at {target.describe()}: that layout has "
                                f"no {'/'.join(dims)} axis to select {selector} on")
            chosen = [chosen] if isinstance(chosen, int) else list(chosen)
            size = x.shape[axis]
            bad = [i for i in chosen if not -size <= i < size]
            if bad:
                raise EditError(f"{type(self).__name__}({selector}={chosen}) at {target.describe()}: "
                                f"{bad} out of range for its {target.dims[axis]} axis of size {size}")
            index[axis] = torch.tensor([i % size for i in chosen], device=x.device)
        return tuple(t.view([-1 if a == axis else 1 for a in range(x.dim())]) for axis, t in enumerate(index))

    def _fit(self, tensor: torch.Tensor, region: torch.Tensor, target: Target) -> torch.Tensor:
        tensor = torch.as_tensor(tensor, device=region.device).to(region.dtype)
        try:
            return tensor.expand_as(region)
        except RuntimeError:
            raise EditError(
                f"{type(self).__name__} at {target.describe()}: got a tensor of shape {tuple(tensor.shape)}, "
                f"expected one broadcastable to {tuple(region.shape)} (the region selected of "
                f"[{' '.join(map(str, target.dims))}])") from None


@dataclass
class Replace(Edit):
    """Replace the value (or the selected region) with ``tensor``, broadcast to it."""

    tensor: torch.Tensor

    def change(self, region, target, index):
        return self._fit(self.tensor, region, target)


@dataclass
class Add(Edit):
    """Add ``scale * tensor`` to the value (or the selected region): steering."""

    tensor: torch.Tensor
    scale: float = 1.0

    def change(self, region, target, index):
        return region + self.scale * self._fit(self.tensor, region, target)


@dataclass
class Scale(Edit):
    """Multiply the value (or the selected region) by ``factor``."""

    factor: float

    def change(self, region, target, index):
        return region * self.factor


@dataclass
class Zero(Edit):
    """Set the value (or the selected region) to zero: ablation."""

    def change(self, region, target, index):
        return torch.zeros_like(region)


def apply_edit(edit, x: torch.Tensor, target: Target) -> torch.Tensor:
    """Apply one edit (an ``Edit`` or any callable) to ``x`` and check what comes back."""
    if isinstance(edit, Edit):
        return edit.apply(x, target)
    if not callable(edit):
        raise EditError(f"the edit at {target.describe()} is {edit!r}: give Replace, Add, Scale, Zero or a "
                        f"function tensor -> tensor")
    out = edit(x)
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise EditError(f"the function edit at {target.describe()} returned {got}; it must return a tensor of "
                        f"the value's shape {tuple(x.shape)}")
    return out.to(x.dtype)


Editable = Edit | Callable[[torch.Tensor], torch.Tensor]
