"""Autograd for qgraph's custom ops: gradients by recomputing the forward under plain autograd.

Every op in ``qgraph.kernels.ops`` runs pure-torch code (the model's own delta-rule kernels, the
chunked states kernel, sdpa per image). Their backward recomputes that
same code with autograd on and differentiates it (``torch.autograd.grad`` with the incoming output
gradients), so the gradients are exactly those of the plain model's autograd through its own kernel.

The backward is itself an opaque custom op (``qgraph::delta_rule_backward``,
``qgraph::delta_rule_states_backward``, ``qgraph::varlen_attention_backward``, each with a fake
kernel), so ``torch.compile`` / AOTAutograd put one node in the backward graph instead of tracing
into the recomputation. What this costs: one extra forward of each kernel per backward (as
activation checkpointing does); nothing is kept from the forward but its inputs.

Gradients flow to the floating-point tensor inputs; integer tensors (``positions``, ``heads``,
``cu_seqlens``) and the non-tensor arguments get ``None``. An output whose gradient is ``None``
(unused by the loss) is left out of the recomputation's backward; the state-emitting kernel then
skips its per-token states altogether. Double backward (``create_graph=True``) is not supported.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence

import torch

from ..compat import autograd_enabled
from . import delta_states
from . import ops

__all__ = ["recompute_grads"]

def _differentiable(x) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def recompute_grads(function: Callable, inputs: Sequence, grad_outputs: Sequence[torch.Tensor | None]) -> list:
    """Gradients of ``function(*inputs)`` for ``grad_outputs`` (one per output, None for unused).

    Returns one entry per input: a contiguous gradient for each floating-point tensor input (zeros
    where the outputs do not depend on it), None for the others.
    """
    with autograd_enabled():
        leaves = [x.detach().requires_grad_() if _differentiable(x) else x for x in inputs]
        wrt = [x for x in leaves if _differentiable(x)]
        outputs = function(*leaves)
        pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs)
                 if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad]
        grads: Sequence[torch.Tensor | None] = [None] * len(wrt)
        if pairs:
            grads = torch.autograd.grad([out for out, _ in pairs], wrt, [grad for _, grad in pairs],
                                        allow_unused=True)
    remaining = iter(grads)
    result: list[torch.Tensor | None] = []
    for leaf in leaves:
        if not _differentiable(leaf):
            result.append(None)
            continue
        grad = next(remaining)
        result.append(torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device) if grad is None
                      else grad.contiguous())
    return result


def _grad_like(x: torch.Tensor) -> torch.Tensor:
    """The fake of a gradient for input ``x``: same shape and dtype, contiguous."""
    return x.new_empty(x.shape)


# ---------------------------------------------------------------------------------------------
# qgraph::chunk_gated_delta_rule and qgraph::recurrent_gated_delta_rule

@torch.library.custom_op("qgraph::delta_rule_backward", mutates_args=())
def delta_rule_backward(
    kind: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, use_qk_l2norm_in_kernel: bool, kernels: str,
    grad_output: torch.Tensor | None, grad_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the ``kind`` ("chunk" or "recurrent") delta-rule op for query, key, value, g,
    beta and initial_state, from the model's own kernel recomputed under autograd."""
    def forward(*tensors):
        return ops._run_kernel(kind, *tensors, use_qk_l2norm_in_kernel, kernels)

    return tuple(recompute_grads(forward, (query, key, value, g, beta, initial_state), (grad_output, grad_state)))


@delta_rule_backward.register_fake
def _(kind, query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel, kernels, grad_output, grad_state):
    return tuple(_grad_like(x) for x in (query, key, value, g, beta, initial_state))


# While set (``keep_recomputation()``, around a forward), a delta-rule op recomputes its kernel under
# autograd as it runs and every backward of that forward reuses that graph: for many backwards of one forward
# (an attribution graph's batches of targets), the kernel runs once more in all, not once per backward.
_KEEP: contextvars.ContextVar = contextvars.ContextVar("qgraph_keep_recomputation", default=False)


@contextlib.contextmanager
def keep_recomputation():
    """Delta-rule ops run inside keep their recomputation's graph for every backward of that forward
    (more memory held with the forward's graph, one kernel run instead of one per backward)."""
    token = _KEEP.set(True)
    try:
        yield
    finally:
        _KEEP.reset(token)


def _kept(kind: str, inputs, wants) -> tuple:
    """The kernel recomputed under autograd, with gradients to the inputs that ``wants`` one: its
    ``(outputs, leaves)``, made as the forward runs (a backward under ``torch.func.vmap`` may not make one)."""
    with autograd_enabled():
        leaves = [x.detach().requires_grad_(bool(want) and _differentiable(x)) for x, want in zip(inputs[:6], wants)]
        return ops._run_kernel(kind, *leaves, *inputs[6:8]), leaves


def _kept_grads(ctx, grad_output, grad_state) -> list:
    """The gradients for the inputs that need one, through the kept recomputation."""
    outputs, leaves = ctx.kept
    pairs = [(out, grad) for out, grad in zip(outputs, (grad_output, grad_state)) if grad is not None]
    wanted = [leaf for leaf in leaves if leaf.requires_grad]
    grads = iter(torch.autograd.grad([out for out, _ in pairs], wanted, [grad for _, grad in pairs],
                                     retain_graph=True, allow_unused=True) if pairs and wanted else ())
    return [next(grads) if leaf.requires_grad else None for leaf in leaves]


def _delta_rule_autograd(kind: str):
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:6])
        ctx.use_qk_l2norm_in_kernel, ctx.kernels = inputs[6], inputs[7]
        ctx.set_materialize_grads(False)
        ctx.kept = _kept(kind, inputs, [x.requires_grad for x in inputs[:6]]) if _KEEP.get() else None

    def backward(ctx, grad_output, grad_state):
        if ctx.kept is not None:
            return (*_kept_grads(ctx, grad_output, grad_state), None, None)
        grads = torch.ops.qgraph.delta_rule_backward(kind, *ctx.saved_tensors, ctx.use_qk_l2norm_in_kernel,
                                                     ctx.kernels, grad_output, grad_state)
        return (*grads, None, None)

    return backward, setup_context


for _kind, _op in (("chunk", ops.chunk_gated_delta_rule), ("recurrent", ops.recurrent_gated_delta_rule)):
    _backward, _setup = _delta_rule_autograd(_kind)
    _op.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------------------------
# qgraph::chunk_gated_delta_rule_states

@torch.library.custom_op("qgraph::delta_rule_states_backward", mutates_args=())
def delta_rule_states_backward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, positions: torch.Tensor | None, heads: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool, chunk_size: int, states_dtype: torch.dtype,
    grad_output: torch.Tensor | None, grad_states: torch.Tensor | None, grad_final_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``qgraph::chunk_gated_delta_rule_states`` for query, key, value, g, beta and
    initial_state (an empty tensor when there was none). With no (or an all-zero) gradient for the
    states, the recomputation computes no states."""
    if grad_states is not None and not grad_states.any():
        grad_states = None
    if grad_states is None:  # only output and final state matter: ask for the states at no position
        positions = torch.zeros(0, dtype=torch.long, device=value.device)

    def forward(query, key, value, g, beta, initial_state):
        return delta_states.chunk_gated_delta_rule_with_states(
            query, key, value, g, beta, initial_state=initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            chunk_size=chunk_size, positions=positions, heads=heads, states_dtype=states_dtype)

    grads = recompute_grads(forward, (query, key, value, g, beta, initial_state),
                            (grad_output, grad_states, grad_final_state))
    if grads[5] is None:
        grads[5] = query.new_empty(0)
    return tuple(grads)


@delta_rule_states_backward.register_fake
def _(query, key, value, g, beta, initial_state, positions, heads, use_qk_l2norm_in_kernel, chunk_size, states_dtype,
      grad_output, grad_states, grad_final_state):
    state = query.new_empty(0) if initial_state is None else _grad_like(initial_state)
    return (*(_grad_like(x) for x in (query, key, value, g, beta)), state)


def _states_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:8])
    ctx.options = inputs[8:]  # use_qk_l2norm_in_kernel, chunk_size, states_dtype
    ctx.has_initial_state = inputs[5] is not None
    ctx.set_materialize_grads(False)


def _states_backward(ctx, grad_output, grad_states, grad_final_state):
    grads = torch.ops.qgraph.delta_rule_states_backward(*ctx.saved_tensors, *ctx.options,
                                                         grad_output, grad_states, grad_final_state)
    state_grad = grads[5] if ctx.has_initial_state else None
    return (*grads[:5], state_grad, None, None, None, None, None)


ops.chunk_gated_delta_rule_states.register_autograd(_states_backward, setup_context=_states_setup_context)


# ---------------------------------------------------------------------------------------------
# qgraph::varlen_attention

@torch.library.custom_op("qgraph::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
    grad_output: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``qgraph::varlen_attention`` for query, key and value."""
    def forward(query, key, value):
        return (ops.packed_attention(query, key, value, cu_seqlens, scale),)

    return tuple(recompute_grads(forward, (query, key, value), (grad_output,)))


@varlen_attention_backward.register_fake
def _(query, key, value, cu_seqlens, scale, grad_output):
    return _grad_like(query), _grad_like(key), _grad_like(value)


def _varlen_setup_context(ctx, inputs, output):
    query, key, value, cu_seqlens, scale = inputs
    ctx.save_for_backward(query, key, value, cu_seqlens)
    ctx.scale = scale


def _varlen_backward(ctx, grad_output):
    query, key, value, cu_seqlens = ctx.saved_tensors
    grads = torch.ops.qgraph.varlen_attention_backward(query, key, value, cu_seqlens, ctx.scale, grad_output)
    return (*grads, None, None)


ops.varlen_attention.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# ---------------------------------------------------------------------------------------------
# qgraph::mark (an identity; markers are stripped before a program runs)

ops.mark.register_autograd(lambda ctx, grad: (grad, None))
