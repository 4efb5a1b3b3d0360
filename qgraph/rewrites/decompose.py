"""Decompose one fused sdpa node into explicit scores, softmax and mix, so its pattern has nodes.

Under the default sdpa load the attention is one op with no softmax node. When a block's
``attention_scores`` or ``attention_probabilities`` are asked for, this pass rewrites that block's
sdpa node (that node only) into what the eager load computes: ``q @ kᵀ * scale``, masked with the
dtype's minimum (added, as eager adds its mask), a float32 softmax, then ``@ v``. One difference
from eager, kept so the program computes what sdpa computed: a query row with no allowed key (a
left-padding position) has an all-zero pattern and output, where eager's pattern is uniform.
"""
from __future__ import annotations

import torch
from torch.fx import Graph, Node

from ..errors import NotSupported
from .emit import emitter

aten = torch.ops.aten


def decompose_sdpa(graph: Graph, sdpa: Node) -> None:
    """Replace ``sdpa`` with explicit ops carrying its module scope; the output node's readers are kept."""
    query, key, value = sdpa.args[:3]
    mask = sdpa.args[3] if len(sdpa.args) > 3 else sdpa.kwargs.get("attn_mask")
    dropout = sdpa.args[4] if len(sdpa.args) > 4 else sdpa.kwargs.get("dropout_p", 0.0)
    causal = sdpa.args[5] if len(sdpa.args) > 5 else sdpa.kwargs.get("is_causal", False)
    if dropout or causal:
        raise NotSupported("decomposing sdpa with dropout or is_causal=True is not supported; load the "
                           "model with attn_implementation='eager' instead")
    query_val = query.meta["val"]
    scale = sdpa.kwargs.get("scale") or query_val.shape[-1] ** -0.5
    emit = emitter(graph, sdpa)
    with graph.inserting_before(sdpa):
        if sdpa.kwargs.get("enable_gqa"):
            groups = query_val.shape[-3] // key.meta["val"].shape[-3]
            key = emit(aten.repeat_interleave.self_int, key, groups, -3)
            value = emit(aten.repeat_interleave.self_int, value, groups, -3)
        scores = emit(aten.mul.Tensor, emit(aten.matmul.default, query, emit(aten.transpose.int, key, -2, -1)), scale)
        allowed = None
        if mask is not None:
            if mask.meta["val"].dtype == torch.bool:  # as eager does: add 0 where allowed, the minimum elsewhere
                allowed = emit(aten.any.dim, mask, -1, True)
                mask = emit(aten.where.Scalar, mask, 0.0, torch.finfo(query_val.dtype).min)
                if query_val.dtype != torch.float32:
                    mask = emit(aten.to.dtype, mask, query_val.dtype)
            scores = emit(aten.add.Tensor, scores, mask)
        probabilities = emit(aten.softmax.int, scores, -1, torch.float32)
        if query_val.dtype != torch.float32:
            probabilities = emit(aten.to.dtype, probabilities, query_val.dtype)
        if allowed is not None:  # a query with no allowed key (left padding) gets no attention, as in sdpa
            probabilities = emit(aten.mul.Tensor, probabilities, allowed)
        output = emit(aten.matmul.default, probabilities, value)
    sdpa.replace_all_uses_with(output)
    graph.erase_node(sdpa)
