"""``qgraph::moe_experts``: a mixture-of-experts block's routed experts as one opaque op.

transformers runs the routed experts as a loop over the experts some token picked (``nonzero``,
``where``: data-dependent shapes that ``torch.export`` cannot keep dynamic), or as grouped / batched
matmuls whose graphs depend on the dtype and device and share symbolic sizes across blocks. As one
op the program stays one graph for every prompt, and the op's arguments are the routing values:

    moe_experts(hidden [batch seq hidden], indices [batch seq top_k], expert_weights [batch seq experts],
                gate_up_proj [experts 2*inner hidden], down_proj [experts hidden inner], activation, implementation)

``expert_weights`` is dense: each token's routing weight of every expert, zero for the experts it did
not pick (editing it scales or removes an expert's contribution; it reroutes nothing). The kernel
follows the model's experts implementation (``config._experts_implementation``, read at export and
baked into the program as ``implementation``, as the delta-rule ops name their kernels): "eager" is
transformers' eager loop re-implemented here (ascending experts, ``index_add_``), any other
("grouped_mm", "batched_mm", ...) transformers' own function for it (``compat.run_experts``) on the
top-k weights gathered from ``expert_weights``; either way the sum is the model's bit for bit.
Its backward is an opaque op too, recomputing the forward under autograd (``grad.recompute_grads``).

Asking for the experts' neurons splits the op in two (``rewrites.on_request.SplitExperts``):
``moe_expert_neurons`` (each token's ``act(gate) * up`` in each of its top-k experts, ``[batch seq top_k
inner]``) and ``moe_experts_down`` (their down projections, weighted and summed), with the neurons a
value in between that edits can change. The pair always runs the eager loop, whatever the model's
implementation (transformers' grouped and batched functions keep the neurons inside one call): its
sum is HF's eager experts' bit for bit, and can differ from the model's grouped_mm by a few ulps.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import compat
from .grad import recompute_grads

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def _routed(indices):
    """Each expert some token picked, ascending, with the (token, slot) pairs routed to it.

    The pairs come in transformers' order, by slot and then by token: each expert's matmul gets its
    rows in the same order, hence the same blocking and the same rounding (on AVX-512 a row's result
    depends on where it sits in the matrix)."""
    with torch.no_grad():
        hit = torch.unique(indices).tolist()
    routes = []
    for expert in hit:
        slot, token = torch.where(indices.T == expert)
        routes.append((expert, (token, slot)))
    return routes


def expert_neurons(hidden, indices, gate_up_proj, activation: str, routes=None):
    """``act(gate) * up`` of each token in each of its top-k experts: ``[..., top_k, inner]``
    (``routes``: ``_routed`` of the flattened indices, where the caller has it already)."""
    flat, top = hidden.reshape(-1, hidden.shape[-1]), indices.reshape(-1, indices.shape[-1])
    act = ACTIVATIONS[activation]
    out = flat.new_zeros(*top.shape, gate_up_proj.shape[1] // 2)
    for expert, (token, slot) in routes or _routed(top):
        gate, up = F.linear(flat[token], gate_up_proj[expert]).chunk(2, dim=-1)
        out = out.index_put((token, slot), act(gate) * up)
    return out.reshape(*indices.shape, -1)


def experts_down(neurons, indices, expert_weights, down_proj, routes=None):
    """The routed experts' weighted sum ``[..., hidden]`` from their neurons, expert by expert ascending."""
    top = indices.reshape(-1, indices.shape[-1])
    flat = neurons.reshape(*top.shape, neurons.shape[-1])
    weights = expert_weights.reshape(top.shape[0], -1).gather(-1, top)
    out = flat.new_zeros(top.shape[0], down_proj.shape[1])
    for expert, (token, slot) in routes or _routed(top):
        current = F.linear(flat[token, slot], down_proj[expert]) * weights[token, slot, None]
        out = out.index_add(0, token, current.to(out.dtype))
    return out.reshape(*indices.shape[:-1], -1)


def experts_loop(hidden, indices, expert_weights, gate_up_proj, down_proj, activation: str):
    """The routed experts' weighted sum ``[batch seq hidden]``, as transformers' eager experts compute it."""
    routes = _routed(indices.reshape(-1, indices.shape[-1]))  # once for both halves
    neurons = expert_neurons(hidden, indices, gate_up_proj, activation, routes)
    return experts_down(neurons, indices, expert_weights, down_proj, routes)


def experts_sum(hidden, indices, expert_weights, gate_up_proj, down_proj, activation: str,
                implementation: str = "eager"):
    """The routed experts' weighted sum ``[batch seq hidden]`` by the experts implementation ``implementation``."""
    if implementation == "eager":
        return experts_loop(hidden, indices, expert_weights, gate_up_proj, down_proj, activation)
    flat, top = hidden.reshape(-1, hidden.shape[-1]), indices.reshape(-1, indices.shape[-1])
    weights = expert_weights.reshape(top.shape[0], -1).gather(-1, top)  # the router's top-k weights, exactly
    out = compat.run_experts(implementation, flat, top, weights, gate_up_proj, down_proj, ACTIVATIONS[activation])
    return out.reshape(hidden.shape)


@torch.library.custom_op("qgraph::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, indices: torch.Tensor, expert_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, activation: str,
                implementation: str = "eager") -> torch.Tensor:
    return experts_sum(hidden, indices, expert_weights, gate_up_proj, down_proj, activation, implementation)


@moe_experts.register_fake
def _(hidden, indices, expert_weights, gate_up_proj, down_proj, activation, implementation="eager"):
    torch._check(indices.dim() == hidden.dim() and expert_weights.shape[-1] == gate_up_proj.shape[0])
    return hidden.new_empty(hidden.shape)


@torch.library.custom_op("qgraph::moe_expert_neurons", mutates_args=())
def moe_expert_neurons(hidden: torch.Tensor, indices: torch.Tensor, gate_up_proj: torch.Tensor,
                       activation: str) -> torch.Tensor:
    return expert_neurons(hidden, indices, gate_up_proj, activation)


@moe_expert_neurons.register_fake
def _(hidden, indices, gate_up_proj, activation):
    return hidden.new_empty(*indices.shape, gate_up_proj.shape[1] // 2)


@torch.library.custom_op("qgraph::moe_experts_down", mutates_args=())
def moe_experts_down(neurons: torch.Tensor, indices: torch.Tensor, expert_weights: torch.Tensor,
                     down_proj: torch.Tensor) -> torch.Tensor:
    return experts_down(neurons, indices, expert_weights, down_proj)


@moe_experts_down.register_fake
def _(neurons, indices, expert_weights, down_proj):
    return neurons.new_empty(*indices.shape[:-1], down_proj.shape[1])


# -- autograd: each op's backward is an opaque op recomputing its loop under autograd ------------------------
@torch.library.custom_op("qgraph::moe_experts_backward", mutates_args=())
def moe_experts_backward(kind: str, tensors: list[torch.Tensor], activation: str, implementation: str,
                         grad_output: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of the ``kind`` op (``moe_experts``, ``moe_expert_neurons``, ``moe_experts_down``) for
    its tensor arguments, in order (zeros for the integer ``indices``); ``activation`` and
    ``implementation``: its other arguments, "" where it has none."""
    function = _FUNCTIONS[kind]
    args = (*tensors, *(option for option in (activation, implementation) if option))
    grads = recompute_grads(lambda *xs: (function(*xs),), args, (grad_output,))
    return [torch.zeros_like(x) if g is None else g for x, g in zip(tensors, grads)]


@moe_experts_backward.register_fake
def _(kind, tensors, activation, implementation, grad_output):
    return [x.new_empty(x.shape) for x in tensors]


_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "moe_experts": experts_sum, "moe_expert_neurons": expert_neurons, "moe_experts_down": experts_down}


def _autograd(op, kind: str, tensors: int):
    """Register ``op``'s backward: its first ``tensors`` arguments are tensors (the second, ``indices``,
    gets no gradient), the rest (the activation's and implementation's names) none."""
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:tensors])
        ctx.options = (*inputs[tensors:], "", "")[:2]  # activation, implementation ("" where none)
        ctx.others = len(inputs) - tensors

    def backward(ctx, grad_output):
        grads = torch.ops.qgraph.moe_experts_backward(kind, list(ctx.saved_tensors), *ctx.options,
                                                      grad_output.contiguous())
        return (*(None if i == 1 else grad for i, grad in enumerate(grads)), *([None] * ctx.others))

    op.register_autograd(backward, setup_context=setup_context)


_autograd(moe_experts, "moe_experts", 5)
_autograd(moe_expert_neurons, "moe_expert_neurons", 3)
_autograd(moe_experts_down, "moe_experts_down", 4)

MOE_EXPERTS_OP = torch.ops.qgraph.moe_experts.default
NEURONS_OP = torch.ops.qgraph.moe_expert_neurons.default
DOWN_OP = torch.ops.qgraph.moe_experts_down.default
