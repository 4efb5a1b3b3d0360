"""The gated delta rule read as attention, and its writes: the math of the DeltaNet values of
``effective_attention``, ``initial_state_output`` and ``write_values``.

Per value head, with ``S`` ``[key_dim, value_dim]``, q and k after the l2 norm (q times
``key_dim ** -0.5``), ``g`` the log decay and ``beta`` the write strength::

    S_t = exp(g_t) S_{t-1};   d_t = beta_t (v_t - S_t^T k_t);   S_t += k_t d_t^T;   o_t = S_t^T q_t

The output is linear in the values and the initial state. Unrolled, ``o_t = sum_{s<=t} A[t, s] v_s
+ S_0^T M_1 ... M_t q_t`` with ``A[t, s] = beta_s k_s^T M_{s+1} ... M_t q_t`` and ``M_r = exp(g_r) (I -
beta_r k_r k_r^T)``. :func:`effective_attention` evaluates that map exactly by running the chunked
rule on the identity: the values are one-hot over the tokens (``v_s = e_s``, so ``o_t[s] = A[t, s]``)
beside zeros that carry the initial state alone. The order of evaluation is transformers' chunked
one (``delta_states.chunked_system``), which is numerically stable: every decay enters as the exp of
a difference of cumulative log decays that is never positive (so it cannot overflow; a long decay
underflows to an exact 0), the tokens of a chunk are coupled by one unit-lower-triangular solve,
and the chunks by a scan that carries the state. No product of ``M`` is ever formed, and no
division by a decay or a beta. ``A`` is exactly causal (zero above the diagonal).

:func:`chunk_gated_delta_rule_writes` runs the rule with each write an affine function of the one
the model computes, inside the recurrence (``d'_t = scale_t d_t + shift_t``; every later write is
computed from the edited state): how a region edit of ``write_values`` reaches the model.
"""
from __future__ import annotations

import torch

from ..errors import EditError
from .delta_states import chunk_gated_delta_rule_with_states, chunked_system

__all__ = ["effective_attention", "chunk_gated_delta_rule_writes", "write_scale"]


def effective_attention(query, key, g, beta, initial_state, use_qk_l2norm_in_kernel=True, chunk_size=64):
    """``(A [batch value_heads query key], initial_state_output [batch seq value_heads value_dim])``,
    both float32, from the kernel's own inputs (``query``/``key`` ``[b, s, key_heads or value_heads,
    key_dim]``, ``g``/``beta`` ``[b, s, value_heads]``, ``initial_state`` ``[b, value_heads, key_dim,
    value_dim]``)."""
    batch, seq, heads = beta.shape
    value_dim = initial_state.shape[-1]
    eye = torch.eye(seq, dtype=torch.float32, device=beta.device)
    one_hot = eye[None, :, None, :].expand(batch, seq, heads, seq)
    values = torch.cat([one_hot, one_hot.new_zeros(batch, seq, heads, value_dim)], dim=-1)
    state = torch.cat([initial_state.new_zeros(*initial_state.shape[:-1], seq).float(), initial_state.float()], -1)
    output, _, _ = chunk_gated_delta_rule_with_states(
        query.float(), key.float(), values, g.float(), beta.float(), initial_state=state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
        positions=torch.empty(0, dtype=torch.long, device=beta.device))
    return output[..., :seq].permute(0, 2, 1, 3).contiguous(), output[..., seq:].contiguous()


def write_scale(shift: torch.Tensor, lift: torch.Tensor) -> torch.Tensor:
    """The per-token, per-head factor ``[b, s, hv]`` of an affine edit of the writes, from the edit's
    image of zeros (``shift``) and of ones (``lift``), both ``[b, s, hv, dv]``. A factor that differs
    along ``value_dim`` would give every value dimension its own delta rule: refused."""
    scale = lift - shift  # (1 + c) - c is 1 only to rounding: compare to it, then take the mean
    loose = 1e-6 * float(shift.detach().abs().amax()) if shift.numel() else 0.0
    if not torch.allclose(scale.detach(), scale.detach()[..., :1].expand_as(scale), rtol=1e-5, atol=loose):
        raise EditError("an edit of 'write_values' scales the write by a factor that differs along value_dim; the "
                        "write enters the recurrence as one vector per head, so scale it by one number per head "
                        "and token (Scale(0.5, positions=..., heads=...)), or Replace it with the vector you want")
    return scale.mean(-1)


def chunk_gated_delta_rule_writes(query, key, value, g, beta, initial_state, shift, lift,
                                  use_qk_l2norm_in_kernel=True, chunk_size=64):
    """The chunked gated delta rule whose write at each token is ``scale * d_t + shift`` (``scale``
    from :func:`write_scale`), computed inside the recurrence: ``(output [b s hv dv] in query's dtype,
    writes [b s hv dv] float32, final state [b hv dk dv] float32)``. ``writes`` are the writes made
    (``S_t - exp(g_t) S_{t-1} = k_t writes_t^T``). With ``shift = 0`` and ``lift = 1`` it is the
    model's rule, and ``writes`` the model's ``d_t``."""
    batch, seq, heads, value_dim = value.shape
    scale = write_scale(shift.float(), lift.float())
    c = chunked_system(query, key, value, g, beta, use_qk_l2norm_in_kernel, chunk_size,
                       write_scale=scale, write_shift=shift.float())
    state = initial_state.to(dtype=torch.float32, copy=True)
    outputs, writes = [], []
    for i in range(c.num_chunks):  # the scan over chunks, as delta_states', keeping each chunk's writes
        written = c.new_values[:, :, i] - c.k_cumdecay[:, :, i] @ state
        outputs.append(c.query_decayed[:, :, i] @ state + c.intra_attn[:, :, i] @ written)
        writes.append(written)
        state = state * c.chunk_decay[:, :, i] + c.key_to_end[:, :, i].transpose(-1, -2) @ written
    # stacked, not written into one buffer: autograd records the scan
    unchunk = lambda x: torch.stack(x, 2).reshape(batch, heads, -1, value_dim)[:, :, :seq].transpose(1, 2)  # noqa: E731
    return unchunk(outputs).to(query.dtype).contiguous(), unchunk(writes).contiguous(), state

