"""``qgraph::edit_slot``: a saved program's edit slot, one opaque node that applies its call's edit.

In memory an edit slot is a ``passes.edit.EditSlot`` submodule. A saved program (``qgraph.load``)
holds no Python modules, so each slot becomes this op, named by its value. The edits of one call
live in a context variable that ``editing`` sets for the call (so threads and nested calls never
see each other's edits); with no edit for its name the op returns a copy of its input.

Autograd: the backward recomputes the call's edit under autograd (``kernels.grad.recompute_grads``),
so gradients flow through an edited slot as through the in-memory program. Tensors held by an edit
(``Add(v)``'s ``v``) get no gradient through a loaded program.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from types import MappingProxyType

import torch

from ..edits import Target, apply_edit
from . import views
from .grad import recompute_grads

# The edits of the call running in this context: {value name: (edit, target, view)}
_EDITS: contextvars.ContextVar[Mapping] = contextvars.ContextVar("qgraph_saved_edits",
                                                             default=MappingProxyType({}))


@contextlib.contextmanager
def editing(edits: Mapping[str, tuple[object, Target, tuple]]):
    """Apply ``{name: (edit, target, view)}`` at the slots of those names in this block."""
    token = _EDITS.set(dict(edits))
    try:
        yield
    finally:
        _EDITS.reset(token)


def _edited(x: torch.Tensor, entry) -> torch.Tensor:
    edit, target, view = entry
    return views.undo(apply_edit(edit, views.apply(x, view), target), view)


@torch.library.custom_op("qgraph::edit_slot", mutates_args=())
def edit_slot(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x``, edited by the edit the current call gives the slot ``name`` (a copy of ``x`` without one)."""
    entry = _EDITS.get().get(name)
    out = torch.empty_like(x)  # a custom op's output may not alias its input
    return out.copy_(x if entry is None else _edited(x, entry))


@edit_slot.register_fake
def _(x, name):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, name = inputs
    ctx.entry = _EDITS.get().get(name)  # the edit of the call being recorded
    if ctx.entry is not None:
        ctx.save_for_backward(x)


def _backward(ctx, grad):
    if ctx.entry is None:
        return grad, None
    (x,) = ctx.saved_tensors
    return recompute_grads(lambda x: (_edited(x, ctx.entry),), (x,), (grad,))[0], None


edit_slot.register_autograd(_backward, setup_context=_setup_context)

EDIT_SLOT_OP = torch.ops.qgraph.edit_slot.default
