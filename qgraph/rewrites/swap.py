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
    state, beside it (the kernel still computes the block): the block's effective attention ``A``, what
    its initial state adds, and a copy of ``A``. The kernel's output becomes ``output + (A - copy) @
    values``, which is the output itself (plus zeros) until an edit at ``A`` moves it by ``(A' - A) @
    values``, so that ``A' @ values + initial_state_output`` is what the block reads; a gradient at
    ``A`` is ``values . d loss / d output``, and the model's own gradients are unchanged (the copy's
    cancels ``A``'s inside the op's backward). Returns the new node."""
    query, key, value, g, beta, initial_state, use_l2norm = kernel.args[:7]
    emit, aten = emitter(graph, kernel), torch.ops.aten
    output = next((u for u in kernel.users if u.target is operator.getitem and u.args[1] == 0), None)
    if output is None:
        with graph.inserting_after(kernel):
            output = emit(operator.getitem, kernel, 0)
    readers = list(output.users)
    with graph.inserting_before(output.next):  # in order, after the output
        read = emit(ATTENTION_READ_OP, query, key, g, beta, initial_state, use_l2norm)
        attention, _, reference = (emit(operator.getitem, read, i) for i in range(3))
        change = emit(aten.sub.Tensor, attention, reference)  # [b h t s]: zeros until A is edited
        values = emit(aten.permute.default, emit(aten._to_copy.default, value, dtype=torch.float32), [0, 2, 1, 3])
        moved = emit(aten.permute.default, emit(aten.matmul.default, change, values), [0, 2, 1, 3])
        total = emit(aten.add.Tensor, emit(aten._to_copy.default, output, dtype=torch.float32), moved)
        edited = emit(aten._to_copy.default, total, dtype=output.meta["val"].dtype)
    for reader in readers:
        reader.replace_input_with(output, edited)
    return read


def read_back(output: Node) -> Node:
    """What a DeltaNet block reads as its kernel's output: ``output`` itself, or after
    :func:`read_as_attention` the output moved by an edit of the effective attention."""
    for cast in output.users:
        if cast.target is torch.ops.aten._to_copy.default:
            for total in cast.users:
                if total.target is torch.ops.aten.add.Tensor and len(total.users) == 1:
                    last = next(iter(total.users))
                    if last.target is torch.ops.aten._to_copy.default:
                        return last
    return output


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
    the plain conv (to float rounding, ~1e-7) until an edit gives a previous call's columns. Returns the
    context node (the edit point) and the last ``w`` columns of ``cat(context, x)`` (the next call's context)."""
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
