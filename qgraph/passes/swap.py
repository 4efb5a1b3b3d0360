"""Rewrites of a DeltaNet block on request: the state-emitting kernel, and an explicit conv context."""
from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from ..delta_states import STATES_OP
from .decompose import fake_result


def swap_for_states(graph: Graph, kernel: Node, positions: Node | None, heads: Node | None,
                    dtype: torch.dtype = torch.float32) -> Node:
    """Replace ``kernel`` (that block only) by ``qgraph::chunk_gated_delta_rule_states`` on the same
    arguments; its output and final state feed what the kernel's fed. ``positions`` (a LongTensor
    node) keeps only those tokens' states, ``heads`` only those value heads'. Returns the new node."""
    query, key, value, g, beta, initial_state, use_l2norm = kernel.args
    with graph.inserting_after(kernel):
        swapped = graph.call_function(STATES_OP, (query, key, value, g, beta, initial_state, positions, heads,
                                                  use_l2norm, 64, dtype))
    swapped.meta.update({k: kernel.meta[k] for k in ("nn_module_stack", "stack_trace") if k in kernel.meta})
    swapped.meta["val"] = fake_result(STATES_OP, swapped.args)
    # the kernel's (output, final state) are the new op's items 0 and 2
    for user in list(kernel.users):
        if user.target is operator.getitem:
            user.args = (swapped, 0 if user.args[1] == 0 else 2)
    graph.erase_node(kernel)
    return swapped


def open_conv_context(graph: Graph, conv: Node) -> tuple[Node, Node]:
    """Give a causal ``conv1d`` (padding ``k - 1`` on the left) an explicit left context instead:
    ``conv(cat(context, x), padding=0)``, the same numbers with a zeros context. Returns the context
    node (an edit point: a previous call's columns continue that call) and the joined input's last
    ``k - 1`` columns (the next call's context)."""
    x, weight, bias, stride, padding, dilation, groups = conv.args
    width = weight.meta["val"].shape[-1] - 1
    meta = {k: conv.meta[k] for k in ("nn_module_stack", "stack_trace") if k in conv.meta}

    def emit(op, *args):
        node = graph.call_function(op, args)
        node.meta.update(meta)
        node.meta["val"] = fake_result(op, args)
        return node

    aten = torch.ops.aten
    with graph.inserting_before(conv):
        context = emit(aten.constant_pad_nd.default, emit(aten.slice.Tensor, x, 2, 0, 0), [width, 0], 0.0)
        joined = emit(aten.cat.default, [context, x], 2)
        tail = emit(aten.slice.Tensor, joined, 2, -width)
    conv.args = (joined, weight, bias, stride, [0], dilation, groups)
    return context, tail
