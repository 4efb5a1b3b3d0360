"""Generation on Qwen3.8-Flash-Next (``qwen4_exp``, issue 58): the cache carries each attention block's keys,
values and indexer keys and each PLE layer's token and conv contexts, so greedy decoding is HF's token for token.

On the tiny checkpoint (QSA on blocks 1 and 3 keeping 2 blocks of 4 tokens and the tail, a PLE layer on block
2), two left-padded prompts long enough that the selection drops keys at every decoding step: tokens, logits
and each step's selection against HF ``generate`` (its indexers hooked), each step's values against a full
forward over the tokens so far, the carried contexts against the tokens, and an edit at every step against a
hook on HF ``generate``.
"""
from __future__ import annotations

import pytest
import torch

import qgraph
from conftest import random_ids

NEW = 6
PROMPT, PADS = 24, 7  # the first row left-padded by 7: 17 real tokens, past the 8-token budget
SELECTION = [f"layers.{i}.self_attn.selected_tokens" for i in (1, 3)]
STEPPED = ["layers.0.layer_output", "layers.3.layer_output", "layers.2.ple.ple_output",
           "layers.2.attention_mix.mix_weights", "layers.3.mlp_mix.injection_weights", "layers.3.self_attn.index_keys",
           "layers.3.self_attn.attention_head_outputs", "final_norm_output"]
CONTEXTS = [f"layers.2.ple.{name}" for name in ("ngram_context_input", "ngram_context_output", "conv_state_input",
                                                "conv_state_output")]


@pytest.fixture(scope="module")
def prompts():
    ids = random_ids(2, PROMPT, seed=11)
    mask = torch.ones_like(ids)
    mask[0, :PADS], ids[0, :PADS] = 0, 256
    return ids, mask


def hf_greedy(model, ids, mask):
    """HF greedy ``generate`` (its logits kept) and each forward's selection on blocks 1 and 3, ``{block: [the
    prompt's [batch query key], then each new token's [batch 1 past + 1]]}``."""
    seen: dict[int, list] = {1: [], 3: []}
    handles = [model.model.layers[i].self_attn.indexer.register_forward_hook(
        lambda module, args, output, i=i: seen[i].append(output[:, 0])) for i in seen]
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                 return_dict_in_generate=True, output_logits=True)
    finally:
        for handle in handles:
            handle.remove()
    return out, seen


def extended(mask, length: int):
    """The attention mask over the prompt and the new tokens, up to ``length``."""
    return torch.cat([mask, torch.ones(mask.shape[0], length - mask.shape[1], dtype=mask.dtype)], 1)


@pytest.mark.compat
@pytest.mark.parametrize("implementation", ("eager", "sdpa"))
def test_greedy_generate_equals_hf_and_its_selection_at_every_step(qwen4_models, prompts, implementation):
    model = qwen4_models(implementation)
    ids, mask = prompts
    out = qgraph.instrument(model, values=SELECTION).generate(ids, mask, max_new_tokens=NEW)
    reference, selections = hf_greedy(model, ids, mask)
    assert torch.equal(out.sequences, reference.sequences)
    assert len(out.logits) == NEW
    for mine, theirs in zip(out.logits, reference.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    for block in (1, 3):
        for k in range(NEW):  # HF's k-th forward: the prompt's, then the one over new token k
            chosen = out.steps[k][f"layers.{block}.self_attn.selected_tokens"]
            assert torch.equal(chosen, selections[block][k]), (block, k)
    for k in range(1, NEW + 1):  # every decoding step drops keys: its budget and the tail of the keys it sees
        chosen = out.steps[k]["layers.3.self_attn.selected_tokens"]
        assert chosen.shape == (2, 1, PROMPT + k)
        seen = extended(mask, PROMPT + k).sum(-1, keepdim=True)
        assert (chosen.sum(-1) < seen).all() and (chosen.sum(-1) >= 8).all()
        assert not chosen[0, 0, :PADS].any()  # the padding is never selected


def test_each_step_equals_a_full_forward_at_its_position(qwen4_models, prompts):
    """Step k's values at its one position are a full forward's at the last of the tokens so far: the streams, the
    PLE layer's output, the mixes, the indexer's keys, the attention, and the selection and block scores of a
    one-token query over its cached keys."""
    ig = qgraph.instrument(qwen4_models("sdpa"), values=[*STEPPED, *SELECTION, "layers.3.self_attn.block_scores"])
    ids, mask = prompts
    out = ig.generate(ids, mask, max_new_tokens=NEW)
    for k, step in enumerate(out.steps):
        length = PROMPT + k
        fresh = ig(out.sequences[:, :length], extended(mask, length))
        for name in STEPPED:
            assert step[name].shape[1] == (PROMPT if k == 0 else 1), name
            torch.testing.assert_close(step[name][:, -1], fresh[name][:, -1], atol=1e-5, rtol=0, msg=f"{name} step {k}")
        for name in SELECTION:
            assert torch.equal(step[name][:, -1], fresh[name][:, -1]), f"{name} step {k}"
        scores = step["layers.3.self_attn.block_scores"]
        assert scores.shape[-1] == length // 4  # every block of the keys so far
        torch.testing.assert_close(scores[:, -1], fresh["layers.3.self_attn.block_scores"][:, -1], atol=1e-5, rtol=0)
    assert out.steps[3]["layers.2.ple.ple_output"].abs().max() > 0.01  # not comparing zeros


def test_the_ple_contexts_carry_the_last_tokens_and_conv_columns(qwen4_models, prompts):
    """A step's n-gram context is the last two token ids so far (eos before a prompt and on its padding), and it
    and the conv context each step reads are what the step before left; each equals what a full forward over the
    tokens so far leaves."""
    ig = qgraph.instrument(qwen4_models("sdpa"), values=CONTEXTS)
    ids, mask = prompts
    out = ig.generate(ids, mask, max_new_tokens=NEW)
    first = out.steps[0]
    assert torch.equal(first["layers.2.ple.ngram_context_input"], torch.full((2, 2), 256))  # eos, as the model pads
    assert first["layers.2.ple.conv_state_input"].abs().max() == 0
    assert first["layers.2.ple.conv_state_input"].shape == (2, 3 * 64, (4 - 1) * 3)  # streams x hidden, taps x dilation
    for k, step in enumerate(out.steps):
        length = PROMPT + k
        assert torch.equal(step["layers.2.ple.ngram_context_output"], out.sequences[:, length - 2:length])
        fresh = ig(out.sequences[:, :length], extended(mask, length))
        for name in ("ngram_context_output", "conv_state_output"):
            torch.testing.assert_close(step[f"layers.2.ple.{name}"], fresh[f"layers.2.ple.{name}"], atol=1e-5, rtol=0)
        if k:
            for name in ("ngram_context", "conv_state"):
                assert torch.equal(step[f"layers.2.ple.{name}_input"], out.steps[k - 1][f"layers.2.ple.{name}_output"])
    assert out.steps[2]["layers.2.ple.conv_state_input"].abs().max() > 0.01


@pytest.mark.compat
def test_a_stream_edit_at_every_step_equals_a_hook_on_hf_generate(qwen4_models, prompts):
    model = qwen4_models("sdpa")
    ids, mask = prompts
    vector = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))  # one direction per stream
    ig = qgraph.instrument(model)
    out = ig.generate(ids, mask, max_new_tokens=NEW, edits={"layers.1.layer_output": qgraph.Add(vector)})
    handle = model.model.layers[1].register_forward_hook(lambda module, args, output: output + vector.flatten())
    try:
        reference, _ = hf_greedy(model, ids, mask)
    finally:
        handle.remove()
    assert torch.equal(out.sequences, reference.sequences)
    for mine, theirs in zip(out.logits, reference.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    plain = ig.generate(ids, mask, max_new_tokens=NEW)
    assert not torch.equal(plain.sequences, out.sequences)  # the edit moves the tokens


@pytest.mark.slow  # the remote door starts a server process
def test_generate_through_every_door(qwen4_models, qwen4_checkpoint, prompts, tmp_path_factory):
    """A ``qgraph serve`` of the checkpoint generates what the local instrument does, its values at every step
    included; a saved program (one forward pass, no cache) refuses by name."""
    from tests.serving import KEY, start_server
    local = qgraph.instrument(qwen4_models("sdpa"), values=SELECTION)
    ids, mask = prompts
    mine = local.generate(ids, mask, max_new_tokens=NEW)
    process, url = start_server(qwen4_checkpoint, tmp_path_factory.mktemp("serve"))
    try:
        served = qgraph.remote(url, api_key=KEY).instrument(SELECTION).generate(ids, mask, max_new_tokens=NEW)
    finally:
        process.kill()
        process.wait(30)
    assert torch.equal(served.sequences, mine.sequences) and len(served.steps) == len(mine.steps)
    for k, step in enumerate(mine.steps):
        for name in SELECTION:
            assert torch.equal(served.steps[k][name], step[name]), (name, k)
    loaded = qgraph.load(local.save(tmp_path_factory.mktemp("saved") / "qwen4.qgraph", weights=True))
    with pytest.raises(qgraph.errors.NotSupported, match="one forward pass, saved without a cache"):
        loaded.generate(ids, mask, max_new_tokens=2)
