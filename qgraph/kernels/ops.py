"""Custom ops that keep the exported graph small, dynamic and readable.

* ``qgraph::chunk_gated_delta_rule`` and ``qgraph::recurrent_gated_delta_rule`` wrap the model's
  gated delta-rule kernels. Exported as plain Python the chunked kernel unrolls into thousands of
  nodes and fixes the sequence length; as an opaque op it is one node whose arguments and outputs
  are exactly the DeltaNet values (queries, keys, values, decays, betas, state in and out).
* ``qgraph::varlen_attention`` is the vision tower's attention over packed images: one node over
  all patches that attends within each image (``cu_seqlens`` bounds), where transformers splits
  per image with ``cu_seqlens.tolist()``, which export cannot follow.
* ``qgraph::mark`` tags a module's input or output during export (see ``qgraph.export``). Markers
  exist only between export and the passes: ``passes.markers`` removes every one of them, so the
  program that runs has none.
* ``qgraph::chunk_gated_delta_rule_states`` is the chunked kernel that also returns the state after
  every token (or after chosen tokens, for chosen heads): ``rewrites.swap`` puts it in place of
  ``qgraph::chunk_gated_delta_rule`` when states are asked for. Its math is
  ``qgraph.kernels.delta_states``.

Every op here has autograd: ``qgraph.kernels.grad`` (imported with ``qgraph.kernels``) registers
backwards that recompute the op's forward under plain autograd, so gradients through a program
equal the plain model's.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import InternalError, InvalidArgument
from .delta_states import chunk_gated_delta_rule_with_states

# The kernels the ops run, by name: each delta-rule node names its kernels in its last argument, so a
# program carries the kernels it was exported with (two families, or one family exported under two
# transformers kernels, live side by side in one process). ``qgraph.export`` registers the model
# module's own functions (transformers' pure-torch kernels, or fla's when transformers picked them),
# so the op computes exactly what the model computes. A name not registered in this process (a
# program loaded by ``qgraph.load``, which never imports a modeling file) runs qgraph's own kernel.
KERNELS: dict[str, dict[str, Callable]] = {}


def register_kernels(module: str, kernels: dict[str, Callable]) -> str:
    """The name under which the delta-rule ops run ``kernels`` (``{"chunk": fn, "recurrent": fn}``,
    from ``module``): ``module`` itself, or ``module#2``, ... when other functions hold that name."""
    for n in range(1, len(KERNELS) + 2):
        name = module if n == 1 else f"{module}#{n}"
        held = KERNELS.setdefault(name, dict(kernels))
        if all(held.get(kind) is function for kind, function in kernels.items()):
            return name
    raise InternalError("unreachable: a free name is always found")


def _own_kernel(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    """The gated delta rule by ``kernels.delta_states`` (no per-token state): ``(output, final state)``."""
    output, _, state = chunk_gated_delta_rule_with_states(
        query, key, value, g, beta, initial_state=initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        positions=torch.empty(0, dtype=torch.long, device=query.device))
    return output, state


def check_delta_arguments(where: str, query, key, g, beta, value=None) -> None:
    """Refuse delta-rule arguments whose shapes a model's call never gives (``InvalidArgument``; each delta-rule
    op and its fake check alike, so a saved program is refused at load): keys of the queries' shape ``[b s h
    dk]``, decays and betas ``[b s hv]`` of one shape, values ``[b s hv dv]``, one batch and length throughout.
    The kernels multiply them before reshaping, so shapes that broadcast into each other would make a tensor as
    large as their sizes multiplied, which no output's size shows. (Shapes compared as tuples, 3 µs a check: the
    chunked and recurrent ops, which run in every DeltaNet block of every call, check in their fake alone.)"""
    decays = g.shape
    if key.shape == query.shape and len(decays) == 3 and beta.shape == decays and decays[:2] == query.shape[:2] \
            and (value is None or (value.dim() == 4 and value.shape[:3] == decays)):
        return
    heads = value.shape[2] if value is not None and value.dim() == 4 else decays[-1] if len(decays) == 3 else "heads"
    wanted = [("key", key, query.shape), ("g", g, (*query.shape[:2], heads)), ("beta", beta, decays)]
    if value is not None:
        wanted.append(("value", value, (*decays, value.shape[-1])))
    name, tensor, shape = next((item for item in wanted if item[1].shape != item[2]), wanted[-1])
    raise InvalidArgument(f"{where} takes {name} of shape {list(shape)} beside queries {list(query.shape)}, not "
                          f"{list(tensor.shape)}")


def _run_kernel(kind, query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel, kernels=""):
    output, state = KERNELS.get(kernels, {}).get(kind, _own_kernel)(
        query, key, value, g=g, beta=beta, initial_state=initial_state,
        output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    # Fresh, contiguous outputs: a custom op may not alias its inputs, and the fake kernel below
    # promises contiguous strides.
    return output.contiguous().clone(), state.to(torch.float32).contiguous().clone()


def _fake(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel, kernels=""):
    check_delta_arguments("qgraph::gated_delta_rule", query, key, g, beta, value)
    batch, seq, heads, value_dim = value.shape
    output = value.new_empty(batch, seq, heads, value_dim)
    state = value.new_empty(batch, heads, key.shape[-1], value_dim, dtype=torch.float32)
    return output, state


@torch.library.custom_op("qgraph::chunk_gated_delta_rule", mutates_args=())
def chunk_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, use_qk_l2norm_in_kernel: bool, kernels: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule over a prompt: ``(output [b s hv dv], final state [b hv dk dv])``,
    by the kernels registered as ``kernels`` (``register_kernels``)."""
    return _run_kernel("chunk", query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel, kernels)


@torch.library.custom_op("qgraph::recurrent_gated_delta_rule", mutates_args=())
def recurrent_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, use_qk_l2norm_in_kernel: bool, kernels: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token gated delta rule (decode steps): same arguments and outputs as the chunked op."""
    return _run_kernel("recurrent", query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel, kernels)


chunk_gated_delta_rule.register_fake(_fake)
recurrent_gated_delta_rule.register_fake(_fake)


@torch.library.custom_op("qgraph::varlen_attention", mutates_args=())
def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention within each packed image: q, k, v ``[1, heads, patches, d]`` -> ``[1, patches, heads, d]``."""
    return packed_attention(query, key, value, cu_seqlens, scale)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """What ``qgraph::varlen_attention`` computes, as plain torch (its backward differentiates this)."""
    bounds = cu_seqlens.tolist()
    outputs = [
        F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scale=scale).transpose(1, 2)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outputs, dim=1).contiguous()


@varlen_attention.register_fake
def _(query, key, value, cu_seqlens, scale):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


@torch.library.custom_op("qgraph::mark", mutates_args=())
def mark(x: torch.Tensor, name: str) -> torch.Tensor:
    """Identity that carries a port name through export; removed from the graph before any run."""
    return x.clone()


@mark.register_fake
def _(x, name):
    return torch.empty_like(x)


CHUNK = 64  # the chunked delta rule's chunk (transformers' kernel's and the state-emitting op's)


@torch.library.custom_op("qgraph::chunk_gated_delta_rule_states", mutates_args=())
def chunk_gated_delta_rule_states(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    heads: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    chunk_size: int = CHUNK,
    states_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Opaque op for :func:`chunk_gated_delta_rule_with_states`: ``(output, states, final_state)``.

    One graph node under ``torch.export`` whatever the sequence length; the fake kernel derives
    every output shape from the input shapes (the number of positions from ``positions.shape``).
    """
    _check_states_arguments(positions, heads, chunk_size, states_dtype)
    check_delta_arguments("qgraph::chunk_gated_delta_rule_states", query, key, g, beta, value)
    output, states, final_state = chunk_gated_delta_rule_with_states(
        query, key, value, g, beta, initial_state=initial_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
        positions=positions, heads=heads, states_dtype=states_dtype,
    )
    # All three are freshly computed; contiguous() is a no-op kept as the fake kernel's promise.
    return output.contiguous(), states.contiguous(), final_state.contiguous()


@chunk_gated_delta_rule_states.register_fake
def _(query, key, value, g, beta, initial_state=None, positions=None, heads=None,
      use_qk_l2norm_in_kernel=True, chunk_size=CHUNK, states_dtype=torch.float32):
    _check_states_arguments(positions, heads, chunk_size, states_dtype)
    check_delta_arguments("qgraph::chunk_gated_delta_rule_states", query, key, g, beta, value)
    # Shape arithmetic only, so batch and seq stay symbolic under torch.export.
    batch, seq = query.shape[:2]
    k_dim = key.shape[-1]
    num_v_heads, v_dim = value.shape[-2:]
    num_states = seq if positions is None else positions.shape[0]
    num_sel = num_v_heads if heads is None else heads.shape[0]
    output = query.new_empty(batch, seq, num_v_heads, v_dim)
    states = query.new_empty(batch, num_states, num_sel, k_dim, v_dim, dtype=states_dtype)
    final_state = query.new_empty(batch, num_v_heads, k_dim, v_dim, dtype=torch.float32)
    return output, states, final_state


def _check_states_arguments(positions, heads, chunk_size, states_dtype) -> None:
    """Refuse what qgraph never writes in a state-emitting node (``InvalidArgument``; the op and its fake check
    alike, so a saved program is refused at load): a chunk other than ``CHUNK`` (the kernel holds ``chunk x chunk``
    matrices per chunk and head: a file's chunk of 12,288 took 9.8 GB for 20 tokens), positions or heads
    that are not 1-d integer indices, states of a dtype that is not floating point."""
    where = "qgraph::chunk_gated_delta_rule_states"
    if type(chunk_size) is not int or chunk_size != CHUNK:
        raise InvalidArgument(f"{where} takes chunk_size {CHUNK}, the kernel's chunk, not {chunk_size!r}")
    for name, indices in (("positions", positions), ("heads", heads)):
        if indices is not None and (indices.dim() != 1 or indices.dtype != torch.long):
            raise InvalidArgument(f"{where} takes {name} as 1-d int64 indices, not {indices.dtype} "
                                  f"{list(indices.shape)}")
    if not isinstance(states_dtype, torch.dtype) or not states_dtype.is_floating_point:
        raise InvalidArgument(f"{where} takes a floating-point states_dtype, not {states_dtype!r}")


DELTA_RULE_OPS = (torch.ops.qgraph.chunk_gated_delta_rule.default,
                  torch.ops.qgraph.recurrent_gated_delta_rule.default)
MARK_OP = torch.ops.qgraph.mark.default
VARLEN_ATTENTION_OP = torch.ops.qgraph.varlen_attention.default
STATES_OP = torch.ops.qgraph.chunk_gated_delta_rule_states.default
