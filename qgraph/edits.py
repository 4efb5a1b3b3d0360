"""Edits: what to do to a value. An edit is applied where the value lives in the graph, so every
value read downstream of it sees the edited tensor (and the value itself is captured as edited).

Each tensor edit can select a region by the value's layout axes: ``batch=``, ``positions=`` (the
``seq`` axis, the ``query`` axis of a pattern, the rows of a vision value), ``heads=`` (any heads axis), ``neurons=``
(an ``intermediate_size`` or SAE features axis) and ``experts=`` (a ``num_experts`` axis: a MoE block's
``expert_weights`` or ``router_logits``). A selection is an index or a non-empty list of indices (negative
ones count from the end). Any callable ``f(tensor) -> tensor`` is an edit too; it sees and returns
the whole value.

Edits are checked when made (a selection that is not ints, a tensor that is not numbers) and when
applied (an index out of range, a tensor that does not broadcast, lives on another device or is not
floating): each error names the edit, the value and what to give instead.
"""
from __future__ import annotations

import numbers
import sys
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence

import torch

from .errors import EditError, InvalidArgument, InvalidType

# Which layout dims each selector addresses, in order of preference.
AXES = {
    "batch": ("batch",),
    "positions": ("seq", "query", "image_tokens", "video_tokens", "patches"),
    "heads": ("num_heads", "num_kv_heads", "key_heads", "value_heads", "heads"),
    "neurons": ("intermediate_size", "shared_intermediate_size", "expert_intermediate_size", "d_sae"),
    "experts": ("num_experts",),
}


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
    experts: Sequence[int] | None = field(default=None, kw_only=True)

    def __post_init__(self):
        for selector in AXES:
            chosen = getattr(self, selector)
            if chosen is not None:
                setattr(self, selector, indices(chosen, selector, f"{type(self).__name__}({selector}=...)"))

    def apply(self, x: torch.Tensor, target: Target) -> torch.Tensor:
        """``x`` with the selected region (``positions``, ``heads``, ``neurons``) replaced by ``change`` of it;
        ``x`` itself is not modified."""
        index = self._region(x, target)
        out = x.clone()
        out[index] = self.change(x[index], target, index)
        return out

    def change(self, region: torch.Tensor, target: Target, index) -> torch.Tensor:
        """The new values of ``region`` (the value at ``index``): what a subclass defines."""
        raise NotImplementedError

    def _region(self, x: torch.Tensor, target: Target):
        """An open-mesh index of the selected region: one broadcastable index tensor per axis."""
        index = [torch.arange(size, device=x.device) for size in x.shape]
        for selector, dims in AXES.items():
            chosen = getattr(self, selector)
            if chosen is None:
                continue
            axis = next((target.dims.index(d) for d in dims if d in target.dims), None)
            if axis is None:
                raise EditError(f"{type(self).__name__}({selector}=...) at {target.describe()}: that layout has "
                                f"no {'/'.join(dims)} axis to select {selector} on")
            chosen = indices(chosen, selector, f"{type(self).__name__}({selector}=...) at {target.describe()}")
            size = x.shape[axis]
            bad = [i for i in chosen if not -size <= i < size]
            if bad:
                raise EditError(f"{type(self).__name__}({selector}={chosen}) at {target.describe()}: "
                                f"{bad} out of range for its {target.dims[axis]} axis of size {size}: give indices "
                                f"from {-size} to {size - 1}")
            index[axis] = torch.tensor([i % size for i in chosen], device=x.device)
        return tuple(t.view([-1 if a == axis else 1 for a in range(x.dim())]) for axis, t in enumerate(index))

    def _fit(self, tensor: torch.Tensor, region: torch.Tensor, target: Target) -> torch.Tensor:
        where = f"{type(self).__name__} at {target.describe()}"
        if not isinstance(tensor, torch.Tensor):  # a number or a nested list, checked at construction
            tensor = torch.as_tensor(tensor, dtype=region.dtype, device=region.device)
        _check_tensor(tensor, region, where)
        tensor = tensor.to(region.dtype)
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

    def __post_init__(self):
        super().__post_init__()
        _check_data(self.tensor, "Replace(tensor=...)")

    def change(self, region, target, index):
        """The tensor given, broadcast to the region."""
        return self._fit(self.tensor, region, target)


@dataclass
class Add(Edit):
    """Add ``scale * tensor`` to the value (or the selected region): steering."""

    tensor: torch.Tensor
    scale: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        _check_data(self.tensor, "Add(tensor=...)")
        if not _is_number(self.scale):
            raise InvalidType(f"Add(scale={self.scale!r}): scale takes a number (the vector is added scale times); "
                              f"give a tensor as Add's tensor instead")

    def change(self, region, target, index):
        """The region plus ``scale`` times the tensor."""
        return region + self.scale * self._fit(self.tensor, region, target)


@dataclass
class Scale(Edit):
    """Multiply the value (or the selected region) by ``factor``: a number, or a tensor broadcast to it."""

    factor: float

    def __post_init__(self):
        super().__post_init__()
        if not _is_number(self.factor):
            _check_data(self.factor, "Scale(factor=...)")

    def change(self, region, target, index):
        """The region times ``factor``."""
        return region * (self.factor if _is_number(self.factor) else self._fit(self.factor, region, target))


@dataclass
class Zero(Edit):
    """Set the value (or the selected region) to zero: ablation."""

    def change(self, region, target, index):
        """Zeros of the region's shape."""
        return torch.zeros_like(region)


def apply_edit(edit, x: torch.Tensor, target: Target) -> torch.Tensor:
    """Apply one edit (an ``Edit`` or any callable) to ``x`` and check what comes back."""
    if isinstance(edit, Edit):
        return edit.apply(x, target)
    if not callable(edit):
        raise EditError(f"the edit at {target.describe()} is {edit!r}: give Replace, Add, Scale, Zero or a "
                        f"function tensor -> tensor")
    try:
        out = edit(x)
    except Exception as error:  # the user's own error, with where it happened
        if sys.version_info >= (3, 11):  # add_note is 3.11's; on 3.10 the error goes up as it is
            error.add_note(f"(raised by the function edit at {target.describe()})")
        raise
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise EditError(f"the function edit at {target.describe()} returned {got}; it must return a tensor of "
                        f"the value's shape {tuple(x.shape)}")
    _check_tensor(out, x, f"the function edit at {target.describe()}", "its result")
    return out.to(x.dtype)


def indices(chosen, what: str, where: str) -> list[int]:
    """``chosen`` (an int, or a non-empty list, tuple or 1-D integer tensor of ints) as a list of
    ints; a ``TypeError`` or ``ValueError`` naming ``where`` and what ``what`` takes otherwise."""
    takes = (f"{what} takes an int or a non-empty list of ints (negative ones count from the end), "
             f"e.g. {what}=[0, -1]")
    if isinstance(chosen, torch.Tensor):
        if chosen.dim() > 1 or chosen.is_floating_point() or chosen.is_complex() or chosen.dtype == torch.bool:
            raise InvalidType(f"{where}: got a {chosen.dtype} tensor of shape {tuple(chosen.shape)}; {takes}")
        chosen = chosen.tolist()
    if type(chosen).__module__ == "numpy":  # an array or a numpy int
        chosen = chosen.tolist()
    if isinstance(chosen, slice):
        raise InvalidType(f"{where}: got {chosen!r}; {takes} (for a range write list(range(start, stop)))")
    if _is_int(chosen):
        return [int(chosen)]
    if isinstance(chosen, (str, bytes)) or not isinstance(chosen, Sequence):
        raise InvalidType(f"{where}: got {type(chosen).__name__} {chosen!r}; {takes}")
    bad = [item for item in chosen if not _is_int(item)]
    if bad:
        raise InvalidType(f"{where}: {bad!r} are not ints; {takes}")
    if not chosen:
        raise InvalidArgument(f"{where}: the list is empty, so it selects nothing; {takes} (leave {what} out to "
                              f"select all)")
    return [int(item) for item in chosen]


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_data(data, where: str) -> None:
    """A tensor, a number or a nested list of numbers; a TypeError naming ``where`` otherwise."""
    if isinstance(data, torch.Tensor):
        return
    try:
        torch.as_tensor(data, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise InvalidType(f"{where}: got {type(data).__name__} {str(data)[:60]!r}; it takes a tensor (or a number, "
                          f"or a nested list of numbers) broadcastable to the value or the region selected") from None


def _check_tensor(tensor: torch.Tensor, value: torch.Tensor, where: str, what: str = "the tensor") -> None:
    """``tensor`` must live on ``value``'s device and be floating when ``value`` is."""
    if tensor.device != value.device:
        raise EditError(f"{where}: {what} is on {tensor.device} but the value is on {value.device}: move it there "
                        f"(.to('{value.device}'))")
    if value.is_floating_point() and not tensor.is_floating_point():
        raise EditError(f"{where}: {what} is {tensor.dtype} but the value is {value.dtype}: give a floating tensor "
                        f"(.to({value.dtype}))")


Editable = Edit | Callable[[torch.Tensor], torch.Tensor]
