"""Tests for qgraph.kernels.delta_states: per-token DeltaNet states from the chunked gated delta rule."""
from __future__ import annotations

import pytest
import torch

from qgraph.errors import InvalidArgument
from qgraph.kernels.delta_states import chunk_gated_delta_rule_with_states
from qgraph.kernels.ops import STATES_OP
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as _transformers_kernel

BATCH, K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 2, 4, 16, 16
SEQS = [1, 7, 63, 64, 65, 130]


def make_inputs(seq, batch=BATCH, initial=True, seed=0):
    """Small random DeltaNet inputs; g <= 0 and beta in (0, 1) as in the model."""
    gen = torch.Generator().manual_seed(seed + 1000 * seq + batch)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    query, key = rand(batch, seq, K_HEADS, K_DIM), rand(batch, seq, K_HEADS, K_DIM)
    value = rand(batch, seq, V_HEADS, V_DIM)
    g = -torch.rand(batch, seq, V_HEADS, generator=gen) * 1.5
    beta = torch.rand(batch, seq, V_HEADS, generator=gen)
    state = rand(batch, V_HEADS, K_DIM, V_DIM) if initial else None
    return query, key, value, g, beta, state


def torch_chunk_gated_delta_rule(query, key, value, *args, **kwargs):
    """transformers' chunked kernel, handed queries and keys repeated to the value heads: from 5.23 it
    repeats them itself (a ratio of 1 repeats nothing), before it the DeltaNet did."""
    ratio = value.shape[2] // key.shape[2]
    return _transformers_kernel(query.repeat_interleave(ratio, dim=2), key.repeat_interleave(ratio, dim=2), value,
                                *args, **kwargs)


def reference_states(query, key, value, g, beta, initial_state):
    """Token-by-token recurrence, written independently: (output, every state) in float32."""
    batch, seq, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[-2:]
    rep = v_heads // k_heads
    q = query.float().repeat_interleave(rep, dim=2)
    k = key.float().repeat_interleave(rep, dim=2)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / k_dim ** 0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    s = torch.zeros(batch, v_heads, k_dim, v_dim) if initial_state is None else initial_state.float().clone()
    outs, states = [], []
    for t in range(seq):
        s = s * g[:, t].float().exp()[..., None, None]
        kv_mem = torch.einsum("bhkv,bhk->bhv", s, k[:, t])
        delta = (value[:, t].float() - kv_mem) * beta[:, t].float()[..., None]
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
        states.append(s)
    return torch.stack(outs, 1), torch.stack(states, 1)


@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("initial", [False, True])
@pytest.mark.compat
def test_matches_transformers_chunked_kernel(seq, initial):
    q, k, v, g, beta, s0 = make_inputs(seq, initial=initial)
    ref_out, ref_state = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, states, final = chunk_gated_delta_rule_with_states(q, k, v, g, beta, initial_state=s0)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(final, ref_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(states[:, -1], ref_state, atol=1e-5, rtol=0)


def test_bfloat16_inputs():
    # The model runs in bf16: math stays float32, the output comes back in the input dtype. The reference is
    # transformers' kernel on float32 copies of the same bf16 numbers, its output rounded to bf16: 5.24's
    # kernel casts to float32 first (the same as given bf16), 5.9's l2-normalises q and k in bf16 before it
    # casts (its final state, float32, is 4e-3 off a float32 recurrence's), which is not the math kept here.
    q, k, v, g, beta, s0 = (x.to(torch.bfloat16) for x in make_inputs(70, initial=True))
    ref_out, ref_state = torch_chunk_gated_delta_rule(
        *(x.float() for x in (q, k, v, g, beta)), initial_state=s0.float(), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    out, states, final = chunk_gated_delta_rule_with_states(q, k, v, g, beta, initial_state=s0)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32 and states.dtype == torch.float32
    torch.testing.assert_close(out, ref_out.to(torch.bfloat16), atol=1e-5, rtol=0)
    torch.testing.assert_close(final, ref_state, atol=1e-5, rtol=0)
    recurrence_out, ref_states = reference_states(q, k, v, g, beta, s0)
    torch.testing.assert_close(out, recurrence_out.to(torch.bfloat16), atol=1e-5, rtol=0)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seq", SEQS)
def test_every_state_matches_token_recurrence(seq):
    q, k, v, g, beta, s0 = make_inputs(seq, initial=True)
    ref_out, ref_states = reference_states(q, k, v, g, beta, s0)
    out, states, _ = chunk_gated_delta_rule_with_states(q, k, v, g, beta, initial_state=s0)
    assert states.shape == (BATCH, seq, V_HEADS, K_DIM, V_DIM) and states.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=0)
    # Chunk boundaries explicitly (64 is the chunk size); state 0 is not the initial state.
    for t in (63, 64, 65):
        if t < seq:
            torch.testing.assert_close(states[:, t], ref_states[:, t], atol=1e-5, rtol=0)
    assert not torch.allclose(states[:, 0], s0, atol=1e-3)


def test_no_l2norm_and_other_chunk_size():
    # Without the l2 norm, with a chunk size that is not a square (block size falls back to 1).
    q, k, v, g, beta, s0 = make_inputs(20, initial=True)
    q, k = q * 0.2, k * 0.2  # keep unnormalised keys small so the recurrence stays bounded
    ref_out, ref_state = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk_size=7, initial_state=s0, output_final_state=True)
    for chunk in (7, 12):
        out, states, final = chunk_gated_delta_rule_with_states(
            q, k, v, g, beta, initial_state=s0, use_qk_l2norm_in_kernel=False, chunk_size=chunk)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, ref_state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[:, -1], ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq", [7, 65, 130])
def test_positions_heads_and_bf16_are_slices_of_full_states(seq):
    q, k, v, g, beta, s0 = make_inputs(seq, initial=True)
    out, full, final = chunk_gated_delta_rule_with_states(q, k, v, g, beta, initial_state=s0)
    positions = torch.tensor([0, 5, seq - 1])
    heads = torch.tensor([3, 1])

    p_out, p_states, p_final = chunk_gated_delta_rule_with_states(
        q, k, v, g, beta, initial_state=s0, positions=positions)
    assert p_states.shape == (BATCH, 3, V_HEADS, K_DIM, V_DIM)
    torch.testing.assert_close(p_states, full[:, positions], atol=1e-6, rtol=0)
    torch.testing.assert_close(p_out, out, atol=0, rtol=0)
    torch.testing.assert_close(p_final, final, atol=0, rtol=0)

    h_out, h_states, _ = chunk_gated_delta_rule_with_states(
        q, k, v, g, beta, initial_state=s0, heads=heads)
    torch.testing.assert_close(h_states, full[:, :, heads], atol=1e-6, rtol=0)
    torch.testing.assert_close(h_out, out, atol=0, rtol=0)

    # Both at once, unsorted and repeated positions.
    mixed = torch.tensor([seq - 1, 0, seq - 1])
    _, ph_states, _ = chunk_gated_delta_rule_with_states(
        q, k, v, g, beta, initial_state=s0, positions=mixed, heads=heads)
    torch.testing.assert_close(ph_states, full[:, mixed][:, :, heads], atol=1e-6, rtol=0)

    _, bf_states, _ = chunk_gated_delta_rule_with_states(
        q, k, v, g, beta, initial_state=s0, states_dtype=torch.bfloat16)
    assert bf_states.dtype == torch.bfloat16
    torch.testing.assert_close(bf_states.float(), full, atol=1e-2 * full.abs().max().item(), rtol=1e-2)
    _, bf_pos, _ = chunk_gated_delta_rule_with_states(
        q, k, v, g, beta, initial_state=s0, positions=positions, states_dtype=torch.bfloat16)
    torch.testing.assert_close(bf_pos, bf_states[:, positions], atol=1e-2, rtol=1e-2)


def test_bad_positions_and_heads_raise():
    q, k, v, g, beta, _ = make_inputs(7)
    with pytest.raises(ValueError):
        chunk_gated_delta_rule_with_states(q, k, v, g, beta, positions=torch.tensor([7]))
    with pytest.raises(ValueError):
        chunk_gated_delta_rule_with_states(q, k, v, g, beta, positions=torch.tensor([-1]))
    with pytest.raises(ValueError):
        chunk_gated_delta_rule_with_states(q, k, v, g, beta, heads=torch.tensor([V_HEADS]))


def test_op_matches_function_and_does_not_alias():
    q, k, v, g, beta, s0 = make_inputs(65, initial=True)
    positions, heads = torch.tensor([1, 64]), torch.tensor([0, 2])
    out, states, final = STATES_OP(q, k, v, g, beta, s0, positions, heads, True, 64, torch.bfloat16)
    f_out, f_states, f_final = chunk_gated_delta_rule_with_states(
        q, k, v, g, beta, initial_state=s0, positions=positions, heads=heads, states_dtype=torch.bfloat16)
    torch.testing.assert_close(out, f_out, atol=0, rtol=0)
    torch.testing.assert_close(states, f_states, atol=0, rtol=0)
    torch.testing.assert_close(final, f_final, atol=0, rtol=0)
    # seq 0 tokens past the initial state would return it unchanged: must still be a fresh tensor.
    empty = [x[:, :0] for x in (q, k, v, g, beta)]
    _, _, same = STATES_OP(*empty, s0, None, None, True, 64, torch.float32)
    torch.testing.assert_close(same, s0, atol=0, rtol=0)
    assert same.untyped_storage().data_ptr() != s0.untyped_storage().data_ptr()


def test_opcheck():
    seq = 65  # crosses a chunk boundary
    q, k, v, g, beta, s0 = make_inputs(seq, initial=True)
    cases = [
        (q, k, v, g, beta, s0, None, None, True, 64, torch.float32),
        (q, k, v, g, beta, None, torch.tensor([0, seq - 1]), torch.tensor([1]), True, 64, torch.bfloat16),
        (q, k, v, g, beta, s0, torch.tensor([seq - 1]), None, False, 64, torch.float32),
    ]
    for args in cases:
        torch.library.opcheck(STATES_OP, args)
    # the op's chunk is the kernel's (the Python function takes any: test_no_l2norm_and_other_chunk_size)
    with pytest.raises(InvalidArgument, match="takes chunk_size 64, the kernel's chunk, not 16"):
        STATES_OP(q, k, v, g, beta, s0, None, None, True, 16, torch.float32)


class _StatesModule(torch.nn.Module):
    def forward(self, query, key, value, g, beta, initial_state, positions):
        out, states, final = torch.ops.qgraph.chunk_gated_delta_rule_states(
            query, key, value, g, beta, initial_state, positions, None, True, 64, torch.float32)
        all_out, all_states, _ = torch.ops.qgraph.chunk_gated_delta_rule_states(
            query, key, value, g, beta, initial_state, None, torch.tensor([0, 3]), True, 64, torch.bfloat16)
        return out * 2, states, final, all_out, all_states


def test_export_with_dynamic_batch_and_seq():
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    dyn = {"query": {0: batch, 1: seq}, "key": {0: batch, 1: seq}, "value": {0: batch, 1: seq},
           "g": {0: batch, 1: seq}, "beta": {0: batch, 1: seq}, "initial_state": {0: batch},
           "positions": None}
    example = make_inputs(9, batch=2) + (torch.tensor([0, 5, 8]),)
    program = torch.export.export(_StatesModule(), example, dynamic_shapes=dyn)
    ops = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count(STATES_OP) == 2
    for b, s in ((2, 9), (3, 70), (2, 130)):
        inputs = make_inputs(s, batch=b, seed=1) + (torch.tensor([0, 5, s - 1]),)
        expected = _StatesModule()(*inputs)
        got = program.module()(*inputs)
        assert got[1].shape == (b, 3, V_HEADS, K_DIM, V_DIM) and got[4].shape == (b, s, 2, K_DIM, V_DIM)
        for e, o in zip(expected, got):
            torch.testing.assert_close(o, e, atol=0, rtol=0)
        # And it is the real kernel: the exported program's output equals transformers'.
        ref_out, _ = torch_chunk_gated_delta_rule(*inputs[:5], initial_state=inputs[5],
                                                  use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(got[0], ref_out * 2, atol=2e-5, rtol=0)


def test_huge_page_state_buffers(monkeypatch):
    import gc

    import qgraph.kernels.buffers as buffers

    q, k, v, g, beta, s0 = make_inputs(70, initial=True)
    _, expected, _ = chunk_gated_delta_rule_with_states(q, k, v, g, beta, initial_state=s0)
    _, expected_bf16, _ = chunk_gated_delta_rule_with_states(
        q, k, v, g, beta, initial_state=s0, states_dtype=torch.bfloat16)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.setattr(buffers, "HUGE_PAGE_MIN_BYTES", 0)  # every buffer through the mmap path
    buf = buffers.empty((3, 5, 7), torch.float32, "cpu")
    assert buf.shape == (3, 5, 7) and buf.is_contiguous() and buf.storage_offset() == 0
    if buf.data_ptr() % (2 << 20) == 0:  # took the huge-page path (Linux)
        buf.fill_(1.5)
        gc.collect()
        assert buf.sum().item() == 1.5 * 105  # the mapping lives as long as the tensor
    _, states, _ = chunk_gated_delta_rule_with_states(q, k, v, g, beta, initial_state=s0)
    _, states_bf16, _ = chunk_gated_delta_rule_with_states(
        q, k, v, g, beta, initial_state=s0, states_dtype=torch.bfloat16)
    del buf
    gc.collect()
    torch.testing.assert_close(states, expected, atol=0, rtol=0)
    torch.testing.assert_close(states_bf16, expected_bf16, atol=0, rtol=0)


def test_gradients_flow_through_states():
    # The Python function is differentiable: gradients of a loss on the states (and output) match
    # those of the token recurrence.
    inputs = make_inputs(70, initial=True)
    weights = torch.randn(BATCH, 70, V_HEADS, K_DIM, V_DIM, generator=torch.Generator().manual_seed(5))
    grads = []
    for fn in ("ours", "reference"):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        if fn == "ours":
            out, states, _ = chunk_gated_delta_rule_with_states(*leaves[:5], initial_state=leaves[5])
        else:
            out, states = reference_states(*leaves)
        ((states * weights).sum() + out.sum()).backward()
        grads.append([x.grad for x in leaves])
    for ours, ref in zip(*grads):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dims", [(K_DIM, V_DIM), (12, 20)])
def test_native_kernel_matches_torch_path(monkeypatch, dims):
    # The C kernel (kernels/states.c) and the torch path compute the same all-token states; where a
    # C compiler exists the C kernel must really run (a silent fallback would hide a broken build).
    import os
    import shutil

    from qgraph.kernels import native

    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: only the torch path exists here")
    monkeypatch.delenv("QGRAPH_NATIVE", raising=False)  # the C kernel on, whatever the shell says
    gen = torch.Generator().manual_seed(7)
    k_dim, v_dim = dims
    q, k = torch.randn(2, 130, 2, k_dim, generator=gen), torch.randn(2, 130, 2, k_dim, generator=gen)
    v = torch.randn(2, 130, 4, v_dim, generator=gen)
    g, beta = -torch.rand(2, 130, 4, generator=gen) * 1.5, torch.rand(2, 130, 4, generator=gen)
    s0 = torch.randn(2, 4, k_dim, v_dim, generator=gen)
    heads = torch.tensor([3, 0, 2])
    calls = []
    real = native.write_chunk_states
    monkeypatch.setattr(native, "write_chunk_states", lambda *a: calls.append(real(*a)) or calls[-1])
    run = lambda **kw: chunk_gated_delta_rule_with_states(q, k, v, g, beta, initial_state=s0, **kw)  # noqa: E731
    fast = [run(), run(heads=heads), run(states_dtype=torch.bfloat16)]
    assert calls and all(calls), "the C kernel did not run"
    monkeypatch.setenv("QGRAPH_NATIVE", "0")
    calls.clear()
    slow = [run(), run(heads=heads), run(states_dtype=torch.bfloat16)]
    assert not any(calls)
    _, reference = reference_states(q, k, v, g, beta, s0)
    for (f_out, f_states, f_final), (s_out, s_states, s_final) in zip(fast, slow):
        assert f_states.dtype == s_states.dtype and f_states.shape == s_states.shape
        torch.testing.assert_close(f_out, s_out, atol=0, rtol=0)  # the output never takes the C path
        torch.testing.assert_close(f_final, s_final, atol=0, rtol=0)
    torch.testing.assert_close(fast[0][1], reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast[0][1], slow[0][1], atol=1e-5, rtol=0)
    torch.testing.assert_close(fast[1][1], fast[0][1][:, :, heads], atol=0, rtol=0)
    # bfloat16 states are the kernel's float32 ones rounded as torch rounds (to nearest even)
    assert torch.equal(fast[2][1], fast[0][1].to(torch.bfloat16))
    torch.testing.assert_close(fast[2][1].float(), slow[2][1].float(), atol=1e-5, rtol=2 ** -7)
