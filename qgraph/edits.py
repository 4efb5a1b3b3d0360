"""Edits: what to do to a value. An edit is applied where the value lives in the graph, so every
value read downstream of it sees the edited tensor (and the value itself is captured as edited).

Each edit but a bare function selects a region by the value's layout axes: ``batch=``, ``positions=``
(the ``seq`` axis, the ``query`` axis of a pattern, the rows of a vision value), ``heads=`` (any heads
axis), ``neurons=`` (an ``intermediate_size`` or SAE features axis), ``experts=`` (a ``num_experts``
axis: a MoE block's ``expert_weights`` or ``router_logits``), ``streams=`` (the ``streams`` axis of a
hyper-connected residual stream and its mixes' weights) and ``keys=`` (the ``key`` axis of a pattern or
a sparse attention's selection). A selection is an index or a non-empty list of indices (negative ones
count from the end). Any callable ``f(tensor) -> tensor`` is an edit too; it sees and returns the whole
value.

A bool value (a sparse attention's ``selected_tokens``) is edited by ``Replace`` with True, False or a
bool tensor, by ``Zero`` (all False) or by a function that returns a bool tensor; ``Add`` and ``Scale``
have no meaning there and are refused, as is a number or a non-bool tensor given for it.

Edits that read the forward: ``Read(name)`` stands wherever an edit takes a tensor
(``Replace(Read("layers.2.layer_output"))``, ``Add(Read(...), scale=0.5)``): that value in the same
forward (as its own edits left it), selected by the edit's region as the edited value is.
``Edit(fn, reads=[...], positions=...)`` calls ``fn(x, reads, mask)`` on the region: ``reads`` the
values named (``{name as written: tensor}``), ``mask`` the call's attention mask along the value's
token axis (bool, True at real tokens; None where the value has no token axis). ``Add(v, scale,
relative=True)`` adds ``scale * m * v``, ``m`` the mean norm of the value's vectors over each row's
real tokens. What an edit reads is wired into the graph (``passes.edit``: its slot takes those values
as inputs), so the edit is exact, differentiable and compiled like any other.

Edits are checked when made (a selection that is not ints, a tensor that is not numbers) and when
applied (an index out of range, a tensor that does not broadcast, lives on another device or is not
floating): each error names the edit, the value and what to give instead.
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .edit_checks import check_data, check_tensor, indices, is_number
from .errors import EditError, InvalidType

# Which layout dims each selector addresses, in order of preference.
AXES = {
    "batch": ("batch",),
    "positions": ("seq", "query", "image_tokens", "video_tokens", "patches"),
    "heads": ("num_heads", "num_kv_heads", "key_heads", "value_heads", "heads"),
    "neurons": ("intermediate_size", "shared_intermediate_size", "expert_intermediate_size", "d_sae"),
    "experts": ("num_experts",),
    "streams": ("streams",),
    "keys": ("key",),
}
TOKENS = ("seq", "query")  # the token axes a call's attention mask lines up with
MASK = "attention_mask"  # the value an edit reads for the call's mask


@dataclass(frozen=True)
class Target:
    """Where an edit lands: the value's name, its layout and the dims of that layout."""

    name: str
    layout: str
    dims: tuple

    def describe(self) -> str:
        return f"'{self.name}' ({self.layout})" if self.layout else f"'{self.name}'"


@dataclass(frozen=True)
class Read:
    """The value ``name`` (a standard name, alias or bracket form naming one value) of the same forward,
    where an edit takes a tensor. It must be computed before the value edited."""

    name: str

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise InvalidType(f"Read takes one value's name, e.g. qgraph.Read('layers.2.layer_output'), not "
                              f"{self.name!r}")


class Forward:
    """What an edit slot hands its edits of the forward: ``{name: (tensor as served, Target)}`` of the
    values wired into it (``passes.edit``)."""

    def __init__(self, reads: Mapping[str, tuple[torch.Tensor, Target]] | None = None):
        self.reads = dict(reads or {})

    def get(self, name: str, where: str) -> tuple[torch.Tensor, Target]:
        if name not in self.reads:
            raise EditError(f"{where} reads '{name}', which this program does not hand to its edit slot: give the "
                            f"edit per call (ig(..., edits=...)) or fixed (instrument(..., edits=...)), so the read "
                            f"is wired in")
        return self.reads[name]


@dataclass
class Region:
    """Base of the edits that select a region: the selection, and what ``change`` sees (``Scope``)."""

    batch: Sequence[int] | None = field(default=None, kw_only=True)
    positions: Sequence[int] | None = field(default=None, kw_only=True)
    heads: Sequence[int] | None = field(default=None, kw_only=True)
    neurons: Sequence[int] | None = field(default=None, kw_only=True)
    experts: Sequence[int] | None = field(default=None, kw_only=True)
    streams: Sequence[int] | None = field(default=None, kw_only=True)
    keys: Sequence[int] | None = field(default=None, kw_only=True)
    # whether it edits a bool value (a mask: set or cleared, never summed or scaled)
    on_masks: ClassVar[bool] = True
    # an affine map of the value (a * x + b, with a and b not depending on x): it may be edited inside a
    # kernel, as the map of zeros and of ones (``write_values``)
    affine: ClassVar[bool] = True

    def __post_init__(self):
        for selector in AXES:
            chosen = getattr(self, selector)
            if chosen is not None:
                setattr(self, selector, indices(chosen, selector, f"{type(self).__name__}({selector}=...)"))

    def apply(self, x: torch.Tensor, target: Target, forward: Forward | None = None) -> torch.Tensor:
        """``x`` with the selected region replaced by ``change`` of it; ``x`` itself is not modified."""
        if x.dtype == torch.bool and not self.on_masks:
            raise EditError(f"{type(self).__name__} at {target.describe()}: the value is a bool mask, which has no "
                            f"sums or products; give Replace(True or False, with positions=/keys=/batch= for a "
                            f"region), Replace(a bool tensor), Zero() (all False) or a function returning a bool mask")
        scope = Scope(self, x, target, forward or Forward())
        out = x.clone()
        out[scope.index] = self.change(x[scope.index], scope)
        return out

    def change(self, region: torch.Tensor, scope: Scope) -> torch.Tensor:
        """The new values of ``region``: what a subclass defines."""
        raise NotImplementedError

    def needs(self) -> tuple[str, ...]:
        """The values this edit reads of the forward (its ``Read`` fields' names, and the mask's)."""
        return tuple(dict.fromkeys(value.name for value in self._fields().values() if isinstance(value, Read)))

    def bind(self, resolve: Callable[[str, object], str]) -> Region:
        """A copy whose reads are named by ``resolve(name as written, edit)`` (a standard name)."""
        changes: dict = {key: Read(resolve(value.name, self)) for key, value in self._fields().items()
                         if isinstance(value, Read)}
        return dataclasses.replace(self, **changes) if changes else self

    def _fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def index_of(self, x: torch.Tensor, dims: tuple, where: str, strict: bool = True) -> tuple:
        """An open-mesh index of the selected region of ``x`` (laid out as ``dims``): one broadcastable index
        tensor per axis. A selector whose axis ``dims`` lack is an error (``strict``) or selects nothing."""
        index = [torch.arange(size, device=x.device) for size in x.shape]
        for selector, names in AXES.items():
            chosen = getattr(self, selector)
            if chosen is None:
                continue
            axis = next((dims.index(d) for d in names if d in dims), None)
            if axis is None:
                if not strict:
                    continue
                raise EditError(f"{type(self).__name__}({selector}=...) at {where}: that layout has no "
                                f"{'/'.join(names)} axis to select {selector} on")
            size = x.shape[axis]
            bad = [i for i in chosen if not -size <= i < size]
            if bad:
                raise EditError(f"{type(self).__name__}({selector}={chosen}) at {where}: {bad} out of range for its "
                                f"{dims[axis]} axis of size {size}: give indices from {-size} to {size - 1}")
            index[axis] = torch.tensor([i % size for i in chosen], device=x.device)
        return tuple(t.view([-1 if a == axis else 1 for a in range(x.dim())]) for axis, t in enumerate(index))

    def _given(self, data, region: torch.Tensor, scope: Scope) -> torch.Tensor:
        """``data`` (a tensor, a number, nested lists, or a ``Read``'s region) broadcast to ``region``."""
        tensor = scope.read(data.name) if isinstance(data, Read) else data
        target = scope.target
        if not isinstance(tensor, torch.Tensor):  # a number or a nested list, checked at construction
            # made the value's dtype; a mask's as given (True/False: a number is refused by check_tensor)
            tensor = torch.as_tensor(tensor, dtype=None if region.dtype == torch.bool else region.dtype,
                                     device=region.device)
        what = f"the value '{data.name}' it reads" if isinstance(data, Read) else "the tensor"
        check_tensor(tensor, region, f"{type(self).__name__} at {target.describe()}", what)
        what = what if isinstance(data, Read) else "a tensor"
        tensor = tensor.to(region.dtype)
        try:
            return tensor.expand_as(region)
        except RuntimeError:
            raise EditError(
                f"{type(self).__name__} at {target.describe()}: got {what} of shape {tuple(tensor.shape)}, "
                f"expected one broadcastable to {tuple(region.shape)} (the region selected of "
                f"[{' '.join(map(str, target.dims))}])") from None


class Scope:
    """What an edit's ``change`` sees beyond its region: the value's whole tensor and target, the region's
    index, and, selected as the region is, the values the edit reads and the call's mask."""

    def __init__(self, edit: Region, x: torch.Tensor, target: Target, forward: Forward):
        self.edit, self.x, self.target, self.forward = edit, x, target, forward
        self.where = f"{type(edit).__name__} at {target.describe()}"
        self.index = edit.index_of(x, target.dims, target.describe())

    def read(self, name: str) -> torch.Tensor:
        """The region of the value ``name`` that the edit's selection picks (by that value's own axes)."""
        tensor, target = self.forward.get(name, self.where)
        return tensor[self.edit.index_of(tensor, target.dims, target.describe(), strict=False)]

    def mask(self, region: bool = True) -> torch.Tensor | None:
        """The call's attention mask along the value's token axis, ``[batch, tokens]`` (bool, True at real
        tokens; the last ``tokens`` of the call's, as a decoding step's value has), selected as the region
        (``region``) or whole; None where the value has no batch and token axis."""
        dims = self.target.dims
        axis = next((dims.index(d) for d in TOKENS if d in dims), None)
        if axis is None or "batch" not in dims:
            return None
        mask = self.forward.get(MASK, self.where)[0][:, -self.x.shape[axis]:].bool()
        if not region:
            return mask
        return mask[self.edit.index_of(mask, ("batch", dims[axis]), "the call's attention_mask", strict=False)]

    def mean_norm(self) -> torch.Tensor:
        """Each row's mean norm (over the last axis) of the value at its real tokens, broadcast to the region."""
        x, dims = self.x, self.target.dims
        mask = self.mask(region=False)
        if mask is None or dims[0] != "batch":
            raise EditError(f"{self.where}: relative=True scales by the mean norm over each row's tokens, and this "
                            f"value has no [batch ... seq ...] layout; add an absolute vector (relative=False)")
        axis = next(dims.index(d) for d in TOKENS if d in dims)
        norms = x.norm(dim=-1, keepdim=True)
        weights = mask.to(x.dtype).view([mask.shape[0] if a == 0 else mask.shape[1] if a == axis else 1
                                         for a in range(x.dim())]).expand_as(norms)
        rest = tuple(range(1, x.dim()))
        mean = (norms * weights).sum(rest, keepdim=True) / weights.sum(rest, keepdim=True)
        return mean.expand_as(x)[self.index]


@dataclass
class Replace(Region):
    """Replace the value (or the selected region) with ``tensor`` (or a ``Read``), broadcast to it."""

    tensor: torch.Tensor | Read

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.tensor, Read):
            check_data(self.tensor, "Replace(tensor=...)")

    def change(self, region, scope):
        """The tensor given, broadcast to the region."""
        return self._given(self.tensor, region, scope)


@dataclass
class Add(Region):
    """Add ``scale * tensor`` (or a ``Read``) to the value (or the selected region): steering. With
    ``relative=True`` the vector is also scaled by each row's mean norm of the value at its real tokens
    (nnsight's ``x + scale * x.norm(dim=-1, keepdim=True).mean() * v``, one prompt at a time)."""

    tensor: torch.Tensor | Read
    scale: float = 1.0
    relative: bool = False
    on_masks: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.tensor, Read):
            check_data(self.tensor, "Add(tensor=...)")
        if not is_number(self.scale):
            raise InvalidType(f"Add(scale={self.scale!r}): scale takes a number (the vector is added scale times); "
                              f"give a tensor as Add's tensor instead")
        if not isinstance(self.relative, bool):
            raise InvalidType(f"Add(relative={self.relative!r}) takes True or False")

    @property
    def affine(self) -> bool:  # type: ignore[override]  # the mean norm depends on the value
        """Whether it is an affine map of the value: not when ``relative`` (the mean norm depends on it)."""
        return not self.relative

    def needs(self) -> tuple[str, ...]:
        """The values it reads: its ``Read``'s, and the call's mask when ``relative``."""
        return (*super().needs(), *((MASK,) if self.relative else ()))

    def change(self, region, scope):
        """The region plus ``scale`` times the tensor (times the rows' mean norm, ``relative``)."""
        added = self.scale * self._given(self.tensor, region, scope)
        return region + (added * scope.mean_norm() if self.relative else added)


@dataclass
class Scale(Region):
    """Multiply the value (or the selected region) by ``factor``: a number, or a tensor (or ``Read``)
    broadcast to it."""

    factor: float | torch.Tensor | Read
    on_masks: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        if not is_number(self.factor) and not isinstance(self.factor, Read):
            check_data(self.factor, "Scale(factor=...)")

    def change(self, region, scope):
        """The region times ``factor``."""
        return region * (self.factor if is_number(self.factor) else self._given(self.factor, region, scope))


@dataclass
class Zero(Region):
    """Set the value (or the selected region) to zero: ablation."""

    def change(self, region, scope):
        """Zeros of the region's shape."""
        return torch.zeros_like(region)


@dataclass
class Edit(Region):
    """A function edit of the selected region that reads the forward: ``fn(x, reads, mask)`` returns the
    region's new values. ``reads``: the values named in ``reads=`` (``{name as written: tensor}``, each
    selected as the region is), ``mask``: the call's attention mask along the value's token axis (bool
    ``[batch, tokens]`` of the region, True at real tokens; None where the value has none)."""

    fn: Callable
    reads: Sequence[str] = ()
    affine: ClassVar[bool] = False  # any function: not where a kernel edits the value (write_values)
    names: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # as written -> standard

    def __post_init__(self):
        super().__post_init__()
        if not callable(self.fn):
            raise InvalidType(f"Edit takes a function fn(x, reads, mask) -> the region's new values, not "
                              f"{type(self.fn).__name__}")
        reads = [self.reads] if isinstance(self.reads, str) else self.reads
        if not isinstance(reads, Sequence) or not all(isinstance(name, str) and name for name in reads):
            raise InvalidType(f"Edit(reads={self.reads!r}) takes a list of value names, e.g. "
                              f"reads=['layers.2.layer_output']")
        self.reads = tuple(reads)

    def needs(self) -> tuple[str, ...]:
        """The values named in ``reads`` (their standard names, once bound) and the call's mask."""
        return (*dict.fromkeys(self.names.get(name, name) for name in self.reads), MASK)

    def bind(self, resolve):
        """A copy that knows the standard name of each value in ``reads`` (``fn`` still sees them as written)."""
        bound = dataclasses.replace(self)
        bound.names = {name: resolve(name, self) for name in self.reads}
        return bound

    def change(self, region, scope):
        """``fn`` of the region, the regions of its reads and the region's mask, checked."""
        reads = {name: scope.read(self.names.get(name, name)) for name in self.reads}
        return checked(self.fn, (region, reads, scope.mask()), region, scope.target, "the function edit (Edit)")


def apply_edit(edit, x: torch.Tensor, target: Target, forward: Forward | None = None) -> torch.Tensor:
    """Apply one edit (a ``Region`` edit, or any callable of the value) to ``x`` and check what comes back."""
    if isinstance(edit, Region):
        return edit.apply(x, target, forward)
    if not callable(edit):
        raise EditError(f"the edit at {target.describe()} is {edit!r}: give Replace, Add, Scale, Zero, Edit or a "
                        f"function tensor -> tensor")
    return checked(edit, (x,), x, target, "the function edit")


def checked(fn: Callable, args: tuple, x: torch.Tensor, target: Target, what: str) -> torch.Tensor:
    """``fn(*args)``, which must be a tensor of ``x``'s shape on its device (floating where it is), as
    ``x``'s dtype; the user's own error goes up with a note of where it was raised."""
    try:
        out = fn(*args)
    except Exception as error:  # the user's own error, with where it happened
        if sys.version_info >= (3, 11):  # add_note is 3.11's; on 3.10 the error goes up as it is
            error.add_note(f"(raised by {what} at {target.describe()})")
        raise
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise EditError(f"{what} at {target.describe()} returned {got}; it must return a tensor of the "
                        f"{'region' if len(args) > 1 else 'value'}'s shape {tuple(x.shape)}")
    check_tensor(out, x, f"{what} at {target.describe()}", "its result")
    return out.to(x.dtype)


def needs(edit) -> tuple[str, ...]:
    """The values ``edit`` reads of the forward (none for a bare function)."""
    return edit.needs() if isinstance(edit, Region) else ()


Editable = Region | Callable[[torch.Tensor], torch.Tensor]
