"""The chunked gated delta rule, also returning the DeltaNet recurrent state after each token.

Qwen3.5's linear-attention (Gated DeltaNet) blocks keep a per-head state ``S`` of shape
``[k_dim, v_dim]``. For every token ``t`` (all math in float32)::

    S   <- exp(g_t) * S                       # gated decay
    d_t  = beta_t * (v_t - S^T k_t)           # delta-rule correction ("new value")
    S   <- S + k_t d_t^T                      # write
    o_t  = S^T q_t                            # read (q l2-normed and scaled by k_dim ** -0.5)

transformers' ``torch_chunk_gated_delta_rule`` evaluates this in chunks of 64 tokens and only keeps
the state at chunk boundaries. For interpretability we want the state after *every* token (or
after a few chosen tokens). Within a chunk that starts from state ``S_0``, with ``c_t`` the
cumulative log decay from the chunk start to token ``t`` and ``d_j`` the chunk's corrected values::

    S_t = exp(c_t) S_0 + sum_{j <= t} exp(c_t - c_j) k_j d_j^T

so every in-chunk state is a masked, decay-weighted sum of outer products: batched matmuls, no
loop over tokens (the states entering each 8-token block come from a scan over the chunk's blocks,
then every token's state from its block's with one batched matmul per chunk).
:func:`chunk_gated_delta_rule_with_states` runs transformers' chunked algorithm (UT transform per chunk,
sequential scan over chunks) and evaluates that sum per chunk, either for every row or only for the rows
the caller asked for. ``qgraph::chunk_gated_delta_rule_states``
(``qgraph.kernels.ops``) wraps it as an opaque custom op so it exports as one graph node with
dynamic batch/seq; its autograd (``qgraph.kernels.grad``) recomputes
:func:`chunk_gated_delta_rule_with_states` under autograd. The big all-token states buffers come
from ``qgraph.kernels.buffers``. On CPU without autograd the all-token states of each chunk are
written by a C kernel instead (``qgraph.kernels.native``: the per-token recurrence from the same
chunk-start state and corrected values, streamed to memory once), about twice as fast.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..errors import InvalidArgument
from . import native
from .buffers import empty

__all__ = ["chunk_gated_delta_rule_with_states"]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # Same formula as transformers' / fla's l2norm (rsqrt of sum of squares plus eps), so the
    # output matches the model's kernel to rounding.
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)



def _block_size(chunk_size: int) -> int:
    """Largest divisor of ``chunk_size`` not above its square root (8 for the usual 64).

    The full-state evaluation splits each chunk into blocks of this size: block-boundary states
    cost ``(chunk/block) * chunk`` outer-product terms and in-block states ``chunk * block``,
    which is smallest near ``sqrt(chunk)``.
    """
    for size in range(int(math.isqrt(chunk_size)), 0, -1):
        if chunk_size % size == 0:
            return size
    return 1


def _rows_states(state0, key, new_values, cum, pairwise, rows):
    """States after the in-chunk tokens ``rows`` (a list of ints), without the other rows.

    ``state0`` ``[b, h, dk, dv]`` is the state before the chunk, ``key`` ``[b, h, c, dk]`` the
    (normalised, undecayed) keys, ``new_values`` ``[b, h, c, dv]`` the corrected values, ``cum``
    ``[b, h, c]`` the in-chunk cumulative log decay and ``pairwise`` ``[b, h, c, c]`` the masked
    ``exp(c_t - c_j)``. Returns ``[b, h, len(rows), dk, dv]`` float32.
    """
    # Tokens after the last requested row cannot contribute (the mask is causal): drop them.
    span = max(rows) + 1
    index = torch.tensor(rows, device=key.device)
    weights = pairwise[..., :span].index_select(2, index)  # [b, h, r, span]
    # sum_j w[r, j] k_j d_j^T  ==  (k * w[r])^T @ d  : one batched matmul per row.
    weighted_keys = key[:, :, None, :span] * weights[..., None]  # [b, h, r, span, dk]
    states = weighted_keys.transpose(-1, -2) @ new_values[:, :, None, :span]  # [b, h, r, dk, dv]
    decay = cum.index_select(2, index).exp()[..., None, None]
    return states.add_(decay * state0[:, :, None])


def _entering_states(state0, key, new_values, cum_blocks, before):
    """The state entering each block of a chunk, ``[blocks, b, h, dk, dv]`` float32.

    A scan over the chunk's blocks (``chunk / block`` steps of ``block`` tokens each, not over
    tokens): the state entering block ``r`` is the one entering block ``r - 1``, decayed over that
    block, plus that block's decay-weighted outer products -- one small batched matmul per step on
    ``[b * h, dk, dv]``, which stays in cache. ``cum_blocks`` ``[b, h, blocks, block]`` is the
    in-chunk cumulative log decay by block and ``before`` ``[b, h, blocks]`` its value before each
    block (0 for the first).
    """
    batch, heads, n_full, block = cum_blocks.shape
    k_dim, v_dim = key.shape[-1], new_values.shape[-1]
    if n_full == 1:
        return state0[None]
    # For the tokens j of block r - 1: exp(c_end - c_j), c_end the log decay at that block's end;
    # the whole block decays the entering state by exp(c_end - c_start).
    ends = before[..., 1:]  # [b, h, blocks - 1]
    weights = (ends[..., None] - cum_blocks[..., :-1, :]).exp()  # [b, h, blocks - 1, block]
    steps = (ends - before[..., :-1]).exp()[..., None, None]  # [b, h, blocks - 1, 1, 1]
    keys = key[:, :, : (n_full - 1) * block].reshape(batch, heads, n_full - 1, block, k_dim)
    weighted = (keys * weights[..., None]).transpose(-1, -2)  # [b, h, blocks - 1, dk, block]
    values = new_values[:, :, : (n_full - 1) * block].reshape(batch, heads, n_full - 1, block, v_dim)
    if torch.is_grad_enabled() and (state0.requires_grad or key.requires_grad or new_values.requires_grad):
        states = [state0]  # autograd cannot record the in-place scan below
        for r in range(n_full - 1):
            inflow = weighted[:, :, r] @ values[:, :, r]
            states.append(inflow + states[-1] * steps[:, :, r])
        return torch.stack(states)
    entering = torch.empty(n_full, batch, heads, k_dim, v_dim, dtype=torch.float32, device=key.device)
    entering[0] = state0
    for r in range(1, n_full):
        torch.bmm(weighted[:, :, r - 1].reshape(batch * heads, k_dim, block),
                  values[:, :, r - 1].reshape(batch * heads, block, v_dim), out=entering[r].view(-1, k_dim, v_dim))
        entering[r].addcmul_(entering[r - 1], steps[:, :, r - 1])
    return entering


def _write_all_states(out, scratch, state0, key, new_values, cum, pairwise, block):
    """Write the state after every token of one chunk into ``out`` ``[b, length, h, dk, dv]``.

    ``out`` is the chunk's slice of the caller's states buffer (contiguous per batch element,
    any dtype; ``length <= chunk``), ``scratch`` a list shared by the chunks of one call that
    holds, once a non-float32 ``out`` needs it, a float32 buffer of ``out``'s shape (the first chunk's, the longest).
    The other inputs are those of :func:`_rows_states`.

    Two levels so the work is ~``2 * c * block`` outer-product terms instead of ``c * c``: the
    states entering each block of ``block`` tokens come from :func:`_entering_states`, then each
    token's state is its block's entering state decayed plus the decay-weighted outer products of
    its own block only, all of the chunk's tokens in one batched matmul. The per-token states -- the only
    large tensor -- are written by ``bmm`` directly into the (float32) output and finished in place, so no
    chunk-sized temporary is allocated per chunk: on CPU, first-touching fresh memory costs as much as the
    math.
    """
    wanted_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (state0, key, new_values, cum))
    if not wanted_grad and native.write_chunk_states(out, state0, key, new_values, cum):
        return  # the C kernel (``states.c``): one streamed write per state
    batch, heads, chunk, k_dim = key.shape
    v_dim = new_values.shape[-1]
    length = out.shape[1]
    n_full = length // block  # whole blocks; the last partial chunk may end mid-block
    done = n_full * block
    if n_full:
        if out.dtype != torch.float32 and not scratch:  # allocated once, its pages touched once
            scratch.append(empty((batch, length, heads, k_dim, v_dim), torch.float32, out.device))
        target = (out if out.dtype == torch.float32 else scratch[0])[:, :done]
        cum_blocks = cum[..., :done].reshape(batch, heads, n_full, block)
        # Log decay accumulated before each block (0 for the first), to rebase decays on block starts.
        before = F.pad(cum_blocks[..., :-1, -1], (1, 0))
        entering = _entering_states(state0, key, new_values, cum_blocks, before)
        # In-block pairwise decays: the diagonal blocks of ``pairwise``.
        local = pairwise[..., :done, :done].reshape(batch, heads, n_full, block, n_full, block)
        local = torch.diagonal(local, dim1=2, dim2=4).permute(0, 1, 4, 2, 3)  # [b, h, nb, row, j]
        keys_b = key[:, :, :done].reshape(batch, heads, n_full, 1, block, k_dim)
        values_b = new_values[:, :, :done].reshape(batch, heads, n_full, 1, block, v_dim)
        # Batch dims ordered (b, block, row, head) so that bmm's output *is* the states layout.
        lhs = (keys_b * local[..., None]).permute(0, 2, 3, 1, 5, 4)  # [b, nb, row, h, dk, j]
        lhs = lhs.reshape(batch, done * heads, k_dim, block)
        rhs = values_b.permute(0, 2, 3, 1, 4, 5).expand(batch, n_full, block, heads, block, v_dim)
        rhs = rhs.reshape(batch, done * heads, block, v_dim)
        # Autograd cannot record ``out=`` calls: when a gradient is wanted, copy instead.
        differentiable = torch.is_grad_enabled() and (lhs.requires_grad or rhs.requires_grad)
        for b in range(batch):  # bmm is 3-D; target[b] is one contiguous block of memory
            dest = target[b].view(done * heads, k_dim, v_dim)
            if differentiable:
                dest.copy_(torch.bmm(lhs[b], rhs[b]))
            else:
                torch.bmm(lhs[b], rhs[b], out=dest)
        decay = (cum_blocks - before[..., None]).exp().permute(0, 2, 3, 1)[..., None, None]
        target.view(batch, n_full, block, heads, k_dim, v_dim).addcmul_(
            decay, entering.permute(1, 0, 2, 3, 4)[:, :, None])
        if out.dtype != torch.float32:
            out[:, :done] = target
    if done < length:
        tail = _rows_states(state0, key, new_values, cum, pairwise, list(range(done, length)))
        out[:, done:] = tail.transpose(1, 2)


class Chunks(NamedTuple):
    """The chunked delta rule's per-chunk terms, float32 ``[batch, value_heads, chunks, chunk, ...]``."""

    num_chunks: int
    key: torch.Tensor  # normalised keys
    cum: torch.Tensor  # in-chunk cumulative log decay [b, h, n, c]
    pairwise: torch.Tensor  # exp(c_t - c_j) for j <= t, else 0 [b, h, n, c, c]
    new_values: torch.Tensor  # the UT solve's values: the writes before the chunk's start state enters
    k_cumdecay: torch.Tensor  # the UT solve's decayed keys: what reads the chunk's start state
    intra_attn: torch.Tensor  # (q k^T) * pairwise
    query_decayed: torch.Tensor
    key_to_end: torch.Tensor
    chunk_decay: torch.Tensor  # [b, h, n, 1, 1]


def chunked_system(query, key, value, g, beta, use_qk_l2norm_in_kernel=True, chunk_size=64,
                   write_scale=None, write_shift=None) -> Chunks:
    """transformers' chunked algorithm up to its scan over chunks: l2 norm and scale, padding to whole
    chunks, the in-chunk decays and the UT transform (a unit-lower-triangular solve per chunk).

    ``write_scale`` ``[b, s, hv]`` and ``write_shift`` ``[b, s, hv, dv]`` (float32) make each write an
    affine function of the one the model computes, inside the recurrence: ``d'_t = write_scale_t * d_t +
    write_shift_t`` (``qgraph.kernels.delta_writes``). The system stays a triangular solve: the keys
    are weighted by ``beta * write_scale`` and the values by that plus the shift."""
    batch, seq, num_k_heads, k_dim = key.shape
    num_v_heads, v_dim = value.shape[-2:]
    if num_v_heads % num_k_heads:
        raise InvalidArgument(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
    if chunk_size < 1:
        raise InvalidArgument(f"chunk_size must be positive, got {chunk_size}")
    device = value.device
    # Grouped value attention: each key head serves num_v_heads // num_k_heads consecutive value heads.
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    # [batch, heads, seq, ...] float32, as the reference kernel does.
    query, key, value, beta, decay = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, g)
    )
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * k_dim ** -0.5

    # Pad to whole chunks. Padded tokens have beta = 0, key = 0 and g = 0, so they leave the state
    # unchanged and the final state of the last chunk is the state after the last real token.
    pad = (chunk_size - seq % chunk_size) % chunk_size
    num_chunks = (seq + pad) // chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))

    strength = beta if write_scale is None else beta * F.pad(write_scale.transpose(1, 2).float(), (0, pad))
    v_beta = value * strength[..., None]
    if write_shift is not None:
        v_beta = v_beta + F.pad(write_shift.transpose(1, 2).float(), (0, 0, 0, pad))
    k_beta = key * strength[..., None]
    chunked = lambda x: x.reshape(batch, num_v_heads, num_chunks, chunk_size, x.shape[-1])  # noqa: E731
    query, key, k_beta, v_beta = (chunked(x) for x in (query, key, k_beta, v_beta))
    cum = decay.reshape(batch, num_v_heads, num_chunks, chunk_size).cumsum(dim=-1)

    # pairwise[..., t, j] = exp(c_t - c_j) for j <= t, 0 above the diagonal (masked before exp so
    # it cannot overflow). It weighs both the UT system and, later, the per-token state sums.
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).triu(1)
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()

    # UT transform: one unit-lower-triangular solve per chunk gives the intra-chunk delta-rule
    # values ("u") and the decayed keys that read the chunk's start state.
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra_attn = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp()[..., None]
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    query_decayed = query * cum.exp()[..., None]
    key_to_end = key * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    return Chunks(num_chunks, key, cum, pairwise, new_values, k_cumdecay, intra_attn, query_decayed, key_to_end,
                  chunk_decay)


def _check_index(name, index, limit):
    if index.dim() != 1 or index.dtype in (torch.bool,) or index.is_floating_point() or index.is_complex():
        raise InvalidArgument(f"{name} must be a 1-D integer tensor, got {tuple(index.shape)} {index.dtype}")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= limit):
        raise InvalidArgument(f"{name} must lie in [0, {limit}), got {index.tolist()}")


def chunk_gated_delta_rule_with_states(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    chunk_size: int = 64,
    positions: torch.Tensor | None = None,
    heads: torch.Tensor | None = None,
    states_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule returning the output, per-token recurrent states and final state.

    Computes the same output as transformers' ``torch_chunk_gated_delta_rule`` (same chunked
    algorithm and float32 math) and additionally the recurrent state after tokens, evaluated per
    chunk with batched matmuls from the chunk's start state.

    Args:
        query, key: ``[batch, seq, num_k_heads, k_dim]``; repeated to the value heads inside.
        value: ``[batch, seq, num_v_heads, v_dim]`` (``num_v_heads`` a multiple of ``num_k_heads``).
        g: log decay ``[batch, seq, num_v_heads]`` (entries <= 0).
        beta: write strength ``[batch, seq, num_v_heads]``.
        initial_state: optional state before the first token, ``[batch, num_v_heads, k_dim, v_dim]``.
        use_qk_l2norm_in_kernel: l2-normalise queries and keys (eps 1e-6) as the model does.
        chunk_size: tokens per chunk (64 in the model).
        positions: optional 1-D integer tensor of token indices in ``[0, seq)`` (already
            normalised: no negative indices). Only those states are computed and kept, in that
            order (duplicates allowed); memory is O(len(positions)) plus per-chunk temporaries.
        heads: optional 1-D integer tensor of value-head indices whose states to return; the
            output always uses every head.
        states_dtype: dtype of the returned states (e.g. ``torch.bfloat16`` to halve memory);
            they are computed in float32 and cast when stored.

    Returns:
        ``(output, states, final_state)``:

        * ``output`` ``[batch, seq, num_v_heads, v_dim]`` in ``query.dtype``;
        * ``states`` ``[batch, seq or len(positions), len(heads) or num_v_heads, k_dim, v_dim]``
          in ``states_dtype``: ``states[:, i]`` is the state after token ``i`` (or
          ``positions[i]``), i.e. the state that token's output was read from;
        * ``final_state`` ``[batch, num_v_heads, k_dim, v_dim]`` float32, the state after the last
          token (the kernel's ``last_recurrent_state``).
    """
    out_dtype = query.dtype
    batch, seq, num_k_heads, k_dim = key.shape
    num_v_heads, v_dim = value.shape[-2:]
    if positions is not None:
        _check_index("positions", positions, seq)
    if heads is not None:
        _check_index("heads", heads, num_v_heads)
    device = value.device
    c = chunked_system(query, key, value, g, beta, use_qk_l2norm_in_kernel, chunk_size)
    num_chunks, key, cum, pairwise = c.num_chunks, c.key, c.cum, c.pairwise

    # State selection. Restricting heads up front keeps the state work proportional to them.
    head_index = heads.to(device=device, dtype=torch.long) if heads is not None else None
    num_sel = num_v_heads if head_index is None else head_index.numel()
    select = (lambda x: x) if head_index is None else (lambda x: x.index_select(1, head_index))  # noqa: E731
    if positions is None:
        states = empty((batch, seq, num_sel, k_dim, v_dim), states_dtype, device)
        wanted: dict[int, list[tuple[int, int]]] = {}
    else:
        states = torch.empty(batch, positions.numel(), num_sel, k_dim, v_dim,
                             dtype=states_dtype, device=device)
        # chunk -> [(slot in the output, row in the chunk)]; one host sync, then no per-chunk syncs.
        wanted = {}
        for slot, pos in enumerate(positions.tolist()):
            wanted.setdefault(pos // chunk_size, []).append((slot, pos % chunk_size))
    block = _block_size(chunk_size)
    scratch: list[torch.Tensor] = []  # float32 staging for other states dtypes (the first chunk is the longest)

    if initial_state is None:
        state = torch.zeros(batch, num_v_heads, k_dim, v_dim, dtype=torch.float32, device=device)
    else:
        # copy=True: the final state must never alias the caller's tensor (custom-op contract).
        state = initial_state.to(device=device, dtype=torch.float32, copy=True)
    output = c.new_values.new_empty(c.new_values.shape)

    # Sequential scan over chunks (never over tokens).
    for i in range(num_chunks):
        v_new = c.new_values[:, :, i] - c.k_cumdecay[:, :, i] @ state
        output[:, :, i] = c.query_decayed[:, :, i] @ state + c.intra_attn[:, :, i] @ v_new
        if positions is None or i in wanted:
            args = (select(state), select(key[:, :, i]), select(v_new), select(cum[:, :, i]),
                    select(pairwise[:, :, i]))
            if positions is None:
                start = i * chunk_size
                _write_all_states(states[:, start:start + chunk_size], scratch, *args, block)
            else:
                slots, rows = zip(*wanted[i])
                chunk_states = _rows_states(*args, list(rows))
                states[:, list(slots)] = chunk_states.transpose(1, 2).to(states_dtype)
        state = state * c.chunk_decay[:, :, i] + c.key_to_end[:, :, i].transpose(-1, -2) @ v_new

    output = output.reshape(batch, num_v_heads, num_chunks * chunk_size, v_dim)[:, :, :seq]
    output = output.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format)
    return output, states, state
