"""DeltaNet states through the instrumented program: the kernel swap, positions, options, and
continuing a prompt from a state (issue 4)."""
from __future__ import annotations

import pytest
import torch

import qgraph

DELTA = [f"layers.{i}.linear_attn" for i in range(3)]  # the DeltaNet blocks before the first attention


def ids_of(batch, seq, seed):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def ids():
    return ids_of(2, 70, seed=11)


@pytest.fixture(scope="module")
def plain(sdpa_model):
    return qgraph.instrument(sdpa_model, values=["layers.*.linear_attn.state_output",
                                                 "layers.*.linear_attn.attention_head_outputs"])


@pytest.fixture(scope="module")
def with_states(sdpa_model):
    return qgraph.instrument(sdpa_model, values={
        "layers.0.linear_attn.states": {},
        "layers.1.linear_attn.state": {"positions": [0, 5, 63, 64, -1]},
        "layers.2.linear_attn.states": {"dtype": torch.bfloat16, "heads": [1, 3]},
        "layers.*.linear_attn.state_output": None,
        "layers.*.linear_attn.attention_*": None,
        "layers.*.linear_attn.decays": None, "layers.*.linear_attn.betas": None,
    })


def reference_states(out, block):
    """Every token's state by the token-by-token recurrence, written here."""
    prefix = f"layers.{block}.linear_attn"
    q, k, v = (out[f"{prefix}.attention_{n}"].float() for n in ("queries", "keys", "values"))
    g, beta = out[f"{prefix}.decays"].float(), out[f"{prefix}.betas"].float()
    groups = v.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state = torch.zeros(v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])
    states = []
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - (state * k[:, t, ..., None]).sum(-2)) * beta[:, t, ..., None]
        state = state + k[:, t, ..., None] * delta[..., None, :]
        states.append(state)
    return torch.stack(states, dim=1)


def test_states_do_not_move_the_logits(with_states, plain, ids):
    torch.testing.assert_close(with_states(ids).logits, plain(ids).logits, atol=1e-5, rtol=0)


def test_last_state_is_the_state_output(with_states, ids):
    out = with_states(ids)
    torch.testing.assert_close(out["layers.0.linear_attn.states"][:, -1], out["layers.0.linear_attn.state_output"],
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("t", [0, 5, 63, 64, 65])
def test_each_state_is_the_final_state_of_the_prefix(with_states, plain, ids, t):
    states = with_states(ids)["layers.0.linear_attn.states"]
    prefix = plain(ids[:, :t + 1])["layers.0.linear_attn.state_output"]
    torch.testing.assert_close(states[:, t], prefix, atol=1e-5, rtol=1e-4)


def test_states_with_padded_prompts(sdpa_model, plain):
    ids = ids_of(3, 20, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[1, :3] = 0
    states = qgraph.instrument(sdpa_model, values=["layers.0.linear_attn.states"])(ids, mask)["layers.0.linear_attn.states"]
    for t in (9, 19):
        prefix = plain(ids[:, :t + 1], mask[:, :t + 1])["layers.0.linear_attn.state_output"]
        torch.testing.assert_close(states[:, t], prefix, atol=1e-5, rtol=1e-4)


@pytest.mark.compat
def test_states_agree_with_a_token_by_token_recurrence(with_states, ids):
    out = with_states(ids)
    reference = reference_states(out, 0)
    torch.testing.assert_close(out["layers.0.linear_attn.states"], reference, atol=1e-5, rtol=1e-4)
    assert reference[:, 10].abs().max() > 1e-4  # the comparison is not between zeros


def test_state_at_positions_is_those_slices_of_states(sdpa_model, with_states, ids):
    everything = qgraph.instrument(sdpa_model, values=["layers.1.linear_attn.states"])(ids)["layers.1.linear_attn.states"]
    chosen = with_states(ids)["layers.1.linear_attn.state"]
    assert chosen.shape[1] == 5
    torch.testing.assert_close(chosen, everything[:, [0, 5, 63, 64, 69]], atol=1e-6, rtol=0)


def test_bfloat16_states_of_chosen_heads(sdpa_model, with_states, ids):
    everything = qgraph.instrument(sdpa_model, values=["layers.2.linear_attn.states"])(ids)["layers.2.linear_attn.states"]
    chosen = with_states(ids)["layers.2.linear_attn.states"]
    assert chosen.dtype == torch.bfloat16 and chosen.shape[2] == 2
    torch.testing.assert_close(chosen.float(), everything[:, :, [1, 3]], atol=1e-4, rtol=1e-2)


@pytest.mark.parametrize("t", [1, 3, 30, 64])
def test_continuing_from_a_state_equals_the_whole_run(sdpa_model, ids, t):
    ig = qgraph.instrument(
        sdpa_model, values=[f"{d}.{v}" for d in DELTA for v in ("state_output", "conv_state_output", "attention_head_outputs")],
        edits=[f"{d}.{v}" for d in DELTA for v in ("state_input", "conv_state_input")])
    whole = ig(ids)
    first = ig(ids[:, :t])
    carried = {}
    for d in DELTA:
        carried[f"{d}.state_input"] = qgraph.Replace(first[f"{d}.state_output"])
        carried[f"{d}.conv_state_input"] = qgraph.Replace(first[f"{d}.conv_state_output"])
    second = ig(ids[:, t:], edits=carried)
    for d in DELTA:
        torch.testing.assert_close(second[f"{d}.attention_head_outputs"], whole[f"{d}.attention_head_outputs"][:, t:],
                                   atol=1e-5, rtol=1e-4)
    # without the conv's context the continuation is wrong: the context really carries
    no_conv = ig(ids[:, t:], edits={k: e for k, e in carried.items() if k.endswith(".state_input")
                                    and "conv" not in k})
    assert not torch.allclose(no_conv[f"{DELTA[0]}.attention_head_outputs"],
                              whole[f"{DELTA[0]}.attention_head_outputs"][:, t:], atol=1e-7)


def test_bad_state_requests_say_what_is_wrong(sdpa_model, ids):
    with pytest.raises(qgraph.UnknownValue, match="full_attention"):
        qgraph.instrument(sdpa_model, values=["layers.3.linear_attn.states"])
    with pytest.raises(ValueError, match="needs positions"):
        qgraph.instrument(sdpa_model, values={"layers.0.linear_attn.state": {}})
    with pytest.raises(ValueError, match="takes no option"):
        qgraph.instrument(sdpa_model, values={"layers.0.linear_attn.states": {"positions": [1]}})
    at = qgraph.instrument(sdpa_model, values={"layers.0.linear_attn.state": {"positions": [2, 50]}})
    with pytest.raises(IndexError, match=r"\[50\] are out of range for a call of 10 tokens"):
        at(ids[:, :10])
    ig = qgraph.instrument(sdpa_model, edits=["layers.0.linear_attn.state_input"])
    with pytest.raises(qgraph.EditError, match=r"state_input.*\(2, 4, 16, 16\)"):
        ig(ids, edits={"layers.0.linear_attn.state_input": qgraph.Replace(torch.zeros(2, 3, 16, 16))})


def test_states_memory_is_reused_only_once_dropped(sdpa_model, ids, monkeypatch):
    from qgraph.kernels import buffers
    monkeypatch.setattr(buffers, "HUGE_PAGE_MIN_BYTES", 0)  # the tiny model's states are small: pool them
    ig = qgraph.instrument(sdpa_model, values=["layers.0.linear_attn.states", "layers.2.linear_attn.states"])
    first = ig(ids)["layers.0.linear_attn.states"]
    kept, address = first.clone(), first.data_ptr()
    second = ig(ids.flip(0))["layers.0.linear_attn.states"]  # `first` is alive: fresh memory, first unchanged
    assert second.data_ptr() != address and torch.equal(first, kept)
    assert torch.allclose(second, kept.flip(0), rtol=1e-5, atol=1e-7)  # the batch rows swapped (matmul blocking may differ)
    del first
    third = ig(ids)["layers.0.linear_attn.states"]  # writes where `first` was
    assert third.data_ptr() == address and torch.equal(third, kept)
    pooled = ig.program_for(False).buffers
    assert pooled.nbytes > 0
    ig.release_buffers()
    assert pooled.nbytes == 0 and torch.equal(third, kept)  # a held tensor keeps its memory
