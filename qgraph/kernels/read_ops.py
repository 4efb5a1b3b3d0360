"""The ops that read a DeltaNet block as attention and edit its writes, with their fakes and autograd.

* ``qgraph::delta_rule_attention``: the exact effective attention of the block's gated delta rule and
  what its initial state adds (``kernels.delta_reads.effective_attention``), from the kernel's own
  inputs, and a copy of the attention (the reference an edit of it is measured from: see
  ``rewrites.swap.read_as_attention``); a node beside the kernel, which still computes the block's output.
* ``qgraph::chunk_gated_delta_rule_writes``: the rule that returns each token's write and takes an
  affine edit of it (``kernels.delta_reads.chunk_gated_delta_rule_writes``); it stands in place of
  the block's kernel when ``write_values`` is asked for or edited.

Autograd recomputes the forward under plain autograd (``kernels.grad.recompute_grads``), as for the
other delta-rule ops: gradients reach every floating input, the edit's shift and lift included.
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgument
from .delta_reads import chunk_gated_delta_rule_writes, effective_attention
from .grad import recompute_grads
from .ops import check_delta_arguments


@torch.library.custom_op("qgraph::delta_rule_attention", mutates_args=())
def delta_rule_attention(query: torch.Tensor, key: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         initial_state: torch.Tensor, use_qk_l2norm_in_kernel: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(effective attention [b hv s s], initial-state output [b s hv dv], a copy of the attention)``, float32."""
    return _attention_read(query, key, g, beta, initial_state, use_qk_l2norm_in_kernel)


def _attention_read(query, key, g, beta, initial_state, use_qk_l2norm_in_kernel):
    check_delta_arguments("qgraph::delta_rule_attention", query, key, g, beta)
    attention, initial = effective_attention(query, key, g, beta, initial_state, use_qk_l2norm_in_kernel)
    return attention, initial, attention.clone()


@delta_rule_attention.register_fake
def _(query, key, g, beta, initial_state, use_qk_l2norm_in_kernel):
    check_delta_arguments("qgraph::delta_rule_attention", query, key, g, beta)
    batch, seq, heads = beta.shape
    attention = beta.new_empty(batch, heads, seq, seq, dtype=torch.float32)
    return attention, beta.new_empty(batch, seq, heads, initial_state.shape[-1], dtype=torch.float32), \
        torch.empty_like(attention)


@torch.library.custom_op("qgraph::chunk_gated_delta_rule_writes", mutates_args=())
def chunk_gated_delta_rule_writes_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, initial_state: torch.Tensor, shift: torch.Tensor,
                                     lift: torch.Tensor, use_qk_l2norm_in_kernel: bool
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(output [b s hv dv], writes [b s hv dv] float32, final state [b hv dk dv] float32)``; each write
    ``(lift - shift) * d_t + shift`` inside the recurrence (``shift`` = 0, ``lift`` = 1: the model's)."""
    check_delta_arguments("qgraph::chunk_gated_delta_rule_writes", query, key, g, beta, value)
    _check_probes(value, shift, lift)
    output, writes, state = chunk_gated_delta_rule_writes(query, key, value, g, beta, initial_state, shift, lift,
                                                          use_qk_l2norm_in_kernel)
    return output.clone(), writes, state.contiguous()


@chunk_gated_delta_rule_writes_op.register_fake
def _(query, key, value, g, beta, initial_state, shift, lift, use_qk_l2norm_in_kernel):
    check_delta_arguments("qgraph::chunk_gated_delta_rule_writes", query, key, g, beta, value)
    _check_probes(value, shift, lift)
    batch, seq, heads, value_dim = value.shape
    return (query.new_empty(batch, seq, heads, value_dim),
            value.new_empty(batch, seq, heads, value_dim, dtype=torch.float32),
            value.new_empty(batch, heads, key.shape[-1], value_dim, dtype=torch.float32))


def _check_probes(value: torch.Tensor, shift: torch.Tensor, lift: torch.Tensor) -> None:
    """Refuse probes of another shape than the values' (``InvalidArgument``; the op and its fake check alike,
    so a saved program is refused at load): ``lift - shift`` would broadcast two tensors the graph made into
    one as large as their sizes multiplied, which no output's size shows."""
    for name, probe in (("shift", shift), ("lift", lift)):
        if probe.shape != value.shape:
            raise InvalidArgument(f"qgraph::chunk_gated_delta_rule_writes takes its {name} shaped as its values "
                                  f"{list(value.shape)}, not {list(probe.shape)}")


def _autograd(op, function, floats: int):
    """Register ``op``'s backward: the gradients of ``function`` over its first ``floats`` arguments
    (the tensors), recomputed; None for the flags after them."""
    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:floats])
        ctx.flags = inputs[floats:]
        ctx.set_materialize_grads(False)

    def backward(ctx, *grads):
        tensors = ctx.saved_tensors
        result = recompute_grads(lambda *xs: function(*xs, *ctx.flags), tensors, grads)
        return (*result, *(None for _ in ctx.flags))

    op.register_autograd(backward, setup_context=setup)


_autograd(delta_rule_attention, _attention_read, 5)
_autograd(chunk_gated_delta_rule_writes_op, chunk_gated_delta_rule_writes, 8)

ATTENTION_READ_OP = torch.ops.qgraph.delta_rule_attention.default
WRITES_OP = torch.ops.qgraph.chunk_gated_delta_rule_writes.default
