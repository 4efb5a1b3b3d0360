"""``qgraph::moe_experts``: a mixture-of-experts block's routed experts as one opaque op.

transformers runs the routed experts as a loop over the experts some token picked (``nonzero``,
``where``: data-dependent shapes that ``torch.export`` cannot keep dynamic), or as grouped / batched
matmuls whose graphs depend on the dtype and device and share symbolic sizes across blocks. As one
op the program stays one graph for every prompt, and the op's arguments are the routing values:

    moe_experts(hidden [batch seq hidden], indices [batch seq top_k], expert_weights [batch seq experts],
                gate_up_proj [experts 2*inner hidden], down_proj [experts hidden inner], activation)

``expert_weights`` is dense: each token's routing weight of every expert, zero for the experts it did
not pick (editing it scales or removes an expert's contribution; it reroutes nothing). The kernel is
transformers' eager loop (ascending experts, ``index_add_``), so the sum is the model's bit for bit.
Its backward is an opaque op too, recomputing the loop under autograd (``grad.recompute_grads``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .grad import recompute_grads

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def experts_loop(hidden, indices, expert_weights, gate_up_proj, down_proj, activation: str):
    """The routed experts' weighted sum ``[batch seq hidden]``, as transformers' eager experts compute it."""
    shape = hidden.shape
    flat = hidden.reshape(-1, shape[-1])
    top_k_index = indices.reshape(-1, indices.shape[-1])
    top_k_weights = expert_weights.reshape(-1, expert_weights.shape[-1]).gather(-1, top_k_index)
    act = ACTIVATIONS[activation]
    out = torch.zeros_like(flat)
    with torch.no_grad():
        hit = F.one_hot(top_k_index, num_classes=gate_up_proj.shape[0]).sum(dim=(0, 1)).nonzero().flatten().tolist()
    for expert in hit:
        token, slot = torch.where(top_k_index == expert)
        gate, up = F.linear(flat[token], gate_up_proj[expert]).chunk(2, dim=-1)
        current = F.linear(act(gate) * up, down_proj[expert]) * top_k_weights[token, slot, None]
        out = out.index_add(0, token, current.to(out.dtype))
    return out.reshape(shape)


@torch.library.custom_op("qgraph::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, indices: torch.Tensor, expert_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, activation: str) -> torch.Tensor:
    return experts_loop(hidden, indices, expert_weights, gate_up_proj, down_proj, activation)


@moe_experts.register_fake
def _(hidden, indices, expert_weights, gate_up_proj, down_proj, activation):
    torch._check(indices.dim() == hidden.dim() and expert_weights.shape[-1] == gate_up_proj.shape[0])
    return hidden.new_empty(hidden.shape)


@torch.library.custom_op("qgraph::moe_experts_backward", mutates_args=())
def moe_experts_backward(hidden: torch.Tensor, indices: torch.Tensor, expert_weights: torch.Tensor,
                         gate_up_proj: torch.Tensor, down_proj: torch.Tensor, activation: str,
                         grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for hidden, expert_weights, gate_up_proj and down_proj (the loop recomputed under autograd)."""
    def forward(hidden, expert_weights, gate_up_proj, down_proj):
        return (experts_loop(hidden, indices, expert_weights, gate_up_proj, down_proj, activation),)

    return tuple(recompute_grads(forward, (hidden, expert_weights, gate_up_proj, down_proj), (grad_output,)))


@moe_experts_backward.register_fake
def _(hidden, indices, expert_weights, gate_up_proj, down_proj, activation, grad_output):
    return tuple(x.new_empty(x.shape) for x in (hidden, expert_weights, gate_up_proj, down_proj))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.activation = inputs[5]


def _backward(ctx, grad_output):
    hidden, indices, expert_weights, gate_up_proj, down_proj = ctx.saved_tensors
    grads = torch.ops.qgraph.moe_experts_backward(hidden, indices, expert_weights, gate_up_proj, down_proj,
                                                  ctx.activation, grad_output.contiguous())
    return grads[0], None, grads[1], grads[2], grads[3], None


moe_experts.register_autograd(_backward, setup_context=_setup_context)

MOE_EXPERTS_OP = torch.ops.qgraph.moe_experts.default
