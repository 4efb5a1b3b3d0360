"""Rewrites of a DeltaNet block on request: the state-emitting kernel, and an explicit conv context."""
from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from ..kernels.ops import STATES_OP
from ..kernels.read_ops import ATTENTION_READ_OP, WRITES_OP
from .emit import emitter, fake_result


def swap_for_states(graph: Graph, kernel: Node, positions: Node | None, heads: Node | None,
                    dtype: torch.dtype = torch.float32) -> Node:
    """Replace ``kernel`` (that block only) by ``qgraph::chunk_gated_delta_rule_states`` on the same
    arguments; its output and final state feed what the kernel's fed. ``positions`` (a LongTensor
    node) keeps only those tokens' states, ``heads`` only those value heads'. Returns the new node."""
    query, key, value, g, beta, initial_state, use_l2norm = kernel.args[:7]  # then the kernels: own kernel here
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


def read_as_attention(graph: Graph, kernel: Node) -> Node:
    """Add ``qgraph::delta_rule_attention`` on ``kernel``'s queries, keys, decays, betas and initial
    state, beside it (the kernel still computes the block): the block's effective attention and what
    its initial state adds. Returns the new node."""
    query, key, _, g, beta, initial_state, use_l2norm = kernel.args[:7]
    with graph.inserting_after(kernel):
        return emitter(graph, kernel)(ATTENTION_READ_OP, query, key, g, beta, initial_state, use_l2norm)


def swap_for_writes(graph: Graph, kernel: Node) -> Node:
    """Replace ``kernel`` by ``qgraph::chunk_gated_delta_rule_writes``, which also returns each token's
    write. It takes the edit of the writes as two probes, what the edit makes of zeros (the shift) and
    of ones (the shift plus the scale): two nodes where the edit slot of ``write_values`` sits. A third,
    zeros added to both (so the scale stays), is what a gradient of the writes is taken at. All three
    are zeros of the values' shape in float32, computed from the values so that gradients reach them.
    Returns the new node."""
    query, key, value, g, beta, initial_state, use_l2norm = kernel.args[:7]
    emit, aten = emitter(graph, kernel), torch.ops.aten
    with graph.inserting_before(kernel):
        zeros = lambda: emit(aten.mul.Tensor, emit(aten._to_copy.default, value, dtype=torch.float32), 0.0)  # noqa: E731
        shift, lift, nudge = zeros(), emit(aten.add.Tensor, zeros(), 1.0), zeros()
        shift, lift = emit(aten.add.Tensor, shift, nudge), emit(aten.add.Tensor, lift, nudge)
        swapped = emit(WRITES_OP, query, key, value, g, beta, initial_state, shift, lift, use_l2norm)
    for user in list(kernel.users):  # the kernel's (output, final state) are the new op's items 0 and 2
        if user.target is operator.getitem:
            user.args = (swapped, 0 if user.args[1] == 0 else 2)
    graph.erase_node(kernel)
    return swapped


def open_conv_context(graph: Graph, conv: Node) -> tuple[Node, Node]:
    """Give a causal ``conv1d`` (left padding ``w = k - 1``, then ``[..., :seq]``) an explicit left
    context: the conv's output gains the context's contribution, ``conv(cat(context, zeros))``
    (non-zero in its first ``w`` columns). The context starts as zeros, so the numbers stay those of
    the plain conv (to float rounding, ~1e-7) until an edit gives a previous call's columns. Returns the context node (the edit point)
    and the last ``w`` columns of ``cat(context, x)`` (the next call's context)."""
    x, weight, _, stride, _, dilation, groups = conv.args
    width = weight.meta["val"].shape[-1] - 1
    output = conv
    while len(output.users) == 1 and next(iter(output.users)).target is torch.ops.qgraph.mark.default:
        output = next(iter(output.users))  # the conv called as a module (nn.Conv1d): its output port
    trimmed = next(u for u in output.users if u.target is torch.ops.aten.slice.Tensor)  # conv(...)[..., :seq]
    emit = emitter(graph, conv)
    aten = torch.ops.aten
    with graph.inserting_before(trimmed.next):
        context = emit(aten.constant_pad_nd.default, emit(aten.slice.Tensor, x, 2, 0, 0), [width, 0], 0.0)
        tail = emit(aten.slice.Tensor, emit(aten.cat.default, [context, x], 2), 2, -width)
        # the context's share of each output column (non-zero in the first `width` only)
        lead = emit(aten.conv1d.default, emit(aten.cat.default, [context, emit(aten.zeros_like.default, x)], 2),
                    weight, None, stride, [0], dilation, groups)
        opened = emit(aten.add.Tensor, trimmed, lead)
    for user in list(trimmed.users):
        if user is not opened:
            user.replace_input_with(trimmed, opened)
    return context, tail
