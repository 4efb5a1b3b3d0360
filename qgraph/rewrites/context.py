"""A left-padded sequence given an explicit context, on request (``PaddedContext`` values).

Where a model pads a sequence on the left with a constant before a causal computation reads it (the zeros
a dilated conv reads before a call's first token, the ids n-gram hashes read before it), that padding is
the context of a prompt's start. ``open_padding`` makes it a node of its own: ``pad(x, [w, 0], value)``
becomes ``cat(context, x)`` with ``context`` the same constant columns (``constant_pad_nd`` of x's empty
slice, so the numbers stay the padding's); ``cat(constant, x)`` keeps its constant as the context. Either
way the last ``w`` columns of the joined sequence are added beside it: the next call's context. A decoding
step (``passes.decode``) feeds the context from its cache and carries the last columns to the next step.
"""
from __future__ import annotations

import torch
from torch.fx import Graph, Node

from .emit import emitter

aten = torch.ops.aten
_PADS = (aten.pad.default, aten.constant_pad_nd.default)
_CONSTANTS = (aten.new_full.default, aten.full.default, aten.new_zeros.default, aten.zeros.default)


def left_padding(node: Node) -> bool:
    """Whether ``node`` pads a sequence on the left with a constant: ``pad(x, [w, 0])`` (constant mode) or
    ``cat([constant, x], dim)``."""
    if node.target in _PADS:
        pads, mode = node.args[1], node.args[2] if node.target is aten.pad.default and len(node.args) > 2 else None
        return len(pads) == 2 and pads[1] == 0 and isinstance(pads[0], int) and pads[0] > 0 \
            and mode in (None, "constant")
    if node.target is aten.cat.default:
        parts = node.args[0]
        return len(parts) == 2 and isinstance(parts[0], Node) and parts[0].target in _CONSTANTS
    return False


def opened(node: Node) -> tuple[Node, Node] | None:
    """``(context, last columns)`` where ``node`` is the ``cat(context, x)`` of an opened padding (a cat of
    two with its last context-width columns taken beside it), else None."""
    if node.target is not aten.cat.default or len(node.args[0]) != 2:
        return None
    context, rank = node.args[0][0], node.meta["val"].dim()
    dim = (node.args[1] if len(node.args) > 1 else 0) % rank
    for user in node.users:
        start = user.args[2] if user.target is aten.slice.Tensor and len(user.args) == 3 else None
        if isinstance(start, int) and user.args[1] % rank == dim and -start == context.meta["val"].shape[dim]:
            return context, user
    return None


def open_padding(graph: Graph, padding: Node) -> tuple[Node, Node]:
    """Give the left padding ``padding`` an explicit context (see the module doc); returns the context node
    (the edit point, what a cached step feeds) and the joined sequence's last columns (the next call's)."""
    emit = emitter(graph, padding)
    if padding.target is aten.cat.default:
        joined, context = padding, padding.args[0][0]
        dim = (padding.args[1] if len(padding.args) > 1 else 0) % padding.meta["val"].dim()
    else:
        x, (width, _) = padding.args[:2]
        at = 2 if padding.target is aten.constant_pad_nd.default else 3  # (x, pad, value) | (x, pad, mode, value)
        value = padding.args[at] if len(padding.args) > at else padding.kwargs.get("value")
        dim = x.meta["val"].dim() - 1
        with graph.inserting_before(padding):
            context = emit(aten.constant_pad_nd.default, emit(aten.slice.Tensor, x, dim, 0, 0), [width, 0],
                           0.0 if value is None else value)
            joined = emit(aten.cat.default, [context, x], dim)
        padding.replace_all_uses_with(joined)
        graph.erase_node(padding)
    with graph.inserting_after(joined):
        tail = emit(aten.slice.Tensor, joined, dim, -context.meta["val"].shape[dim])
    return context, tail
