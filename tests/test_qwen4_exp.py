"""Qwen3.8-Flash-Next (``qwen4_exp``, issue 58): the tiny checkpoint, QSA's selection, the program and its values.

The tiny checkpoint (``qgraph.testing.tiny_qwen4_exp``: 4 blocks, 3 streams, a PLE layer on block 2, QSA on
blocks 1 and 3 with a budget of 2 blocks of 4) is exported once per attention implementation; every
value is compared with forward hooks on the HF forward or with its module's arithmetic from its weights,
and the selection with transformers' own loop (bit-equal masks), left padding included; the image-text model
with an image; the DeltaNet's states with the float64 recurrence.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import pytest
import torch

import qgraph
from conftest import hf_logits, random_ids
from qgraph.families.qwen4_exp import select_tokens
from qgraph.testing import tiny_qwen4_exp

IMPLEMENTATIONS = ("eager", "sdpa")


@pytest.fixture(scope="module")
def checkpoint(qwen4_checkpoint):
    return qwen4_checkpoint


@pytest.fixture(scope="module")
def models(qwen4_models):
    """The checkpoint's model under an attention implementation, shared by the qwen4 test files (conftest)."""
    return qwen4_models


@pytest.fixture(scope="module", params=IMPLEMENTATIONS)
def loaded(request, models):
    """(model, program with every value) under one attention implementation; under sdpa without the attention
    pattern, so its attention stays the fused sdpa node the HF forward runs (asking for the pattern decomposes it)."""
    model = models(request.param)
    ig = qgraph.instrument(model, values=["**"])
    if request.param == "sdpa":
        pattern = ("attention_scores", "attention_probabilities")
        ig = qgraph.instrument(model, values=[name for name in ig.values if not name.endswith(pattern)])
    return model, ig


def padded(seq: int = 37, pads: tuple = (0, 9, 30), seed: int = 5):
    """A batch whose rows are left-padded by ``pads`` tokens (by default the last row's 7 tokens have no
    complete block past the budget; its padded queries see nothing)."""
    ids = random_ids(len(pads), seq, seed=seed)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
        ids[row, :pad] = 256
    return ids, mask


def hooked(model, ids, mask):
    """The HF forward with hooks on every block, mix, PLE layer, indexer and MoE router: (logits, {key: what
    the hook saw})."""
    seen: dict = {}
    modules = {"final_mix": model.model.hyper_connection_mixer}
    for i, layer in enumerate(model.model.layers):
        modules.update({f"{i}.layer": layer, f"{i}.attention_mix": layer.attn_hyper_connection,
                        f"{i}.mlp_mix": layer.mlp_hyper_connection, f"{i}.gate": layer.mlp.gate})
        if layer.ple is not None:
            modules.update({f"{i}.ple": layer.ple, f"{i}.ngrams": layer.ple.ple_embedding})
        if hasattr(layer, "self_attn"):
            modules[f"{i}.indexer"] = layer.self_attn.indexer
    with contextlib.ExitStack() as hooks:
        for key, module in modules.items():
            hooks.callback(module.register_forward_hook(
                lambda module, args, output, key=key: seen.__setitem__(key, (args[0], output))).remove)
        return hf_logits(model, ids, mask), seen


def test_checkpoint_has_every_new_part(checkpoint):
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(checkpoint)
    assert config.model_type == "qwen4_exp_text" and config.hc_count == 3 and config.ple_layer_ids == [3]
    assert config.layer_types.count("indexed_attention") == 2
    assert config.indexer_budget // config.indexer_compress_ratio == 2


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vectorized_selection_equals_transformers_loop(checkpoint, implementation, monkeypatch):
    """The indexer's mask with ``select_tokens`` in place of its loop, bit for bit, on random and left-padded
    batches (the tiny indexer's two heads tie at relu 0 often: the ties pick what the loop picks)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation=implementation).eval()
    whole = (random_ids(2, 70, seed=2), torch.ones(2, 70, dtype=torch.long))
    for ids, mask in (padded(), whole, padded(13, (0, 9, 11), seed=7)):
        logits, loop = hooked(model, ids, mask)
        with monkeypatch.context() as patch:
            patch.setattr(Qwen4ExpTextQSAIndexer, "_select_tokens", select_tokens)
            vectorized_logits, vectorized = hooked(model, ids, mask)
        for i in (1, 3):
            assert torch.equal(vectorized[f"{i}.indexer"][1], loop[f"{i}.indexer"][1]), (implementation, i)
        assert torch.equal(vectorized_logits, logits)
    chosen = loop["1.indexer"][1][0, 0]  # (the last batch's) row 0: 13 real tokens, 3 blocks: 2 kept + tail 1
    assert int(chosen[-1].sum()) == 9 and not loop["1.indexer"][1][2, 0, :11].any()  # padded queries: nothing


def test_logits_equal_the_hf_forward_for_every_prompt(loaded):
    """One program, prompts of several batch sizes and lengths (a selection that keeps all, and one that drops),
    one token and fewer than two blocks of the indexer's included (the export's guards on the block count only pick
    strides: ``Family.named_dims``)."""
    model, ig = loaded
    short = [(random_ids(batch, length, seed=length), torch.ones(batch, length, dtype=torch.long))
             for batch, length in ((1, 1), (2, 3), (1, 4), (2, 7))]
    for ids, mask in (padded(), (random_ids(1, 5, seed=3), torch.ones(1, 5, dtype=torch.long)),
                      (random_ids(2, 70, seed=4), torch.ones(2, 70, dtype=torch.long)), *short):
        logits, _ = hooked(model, ids, mask)
        assert torch.equal(ig(ids, mask).logits, logits)


def test_stream_and_mix_values_equal_hooks_and_weights(loaded):
    model, ig = loaded
    ids, mask = padded()
    out, (logits, seen) = ig(ids, mask), hooked(model, ids, mask)
    batch, seq = ids.shape
    streams = lambda x: x.unflatten(-1, (3, 64))  # noqa: E731
    for i, layer in enumerate(model.model.layers):
        assert torch.equal(out[f"layers.{i}.layer_input"], streams(seen[f"{i}.layer"][0]))
        assert torch.equal(out[f"layers.{i}.layer_output"], streams(seen[f"{i}.layer"][1]))
        assert out[f"layers.{i}.layer_input"].shape == (batch, seq, 3, 64)
        for mix, module in (("attention_mix", layer.attn_hyper_connection), ("mlp_mix", layer.mlp_hyper_connection)):
            stream_in, (mixed, _, injection) = seen[f"{i}.{mix}"]
            assert torch.equal(out[f"layers.{i}.{mix}.mixed_input"], mixed)
            assert torch.equal(out[f"layers.{i}.{mix}.injection_weights"], injection)
            normed = module.hc_norm(stream_in)
            weights = torch.sigmoid(module.input_mix_weight_up(torch.nn.functional.silu(
                module.input_mix_weight_down(normed) / 3)))
            assert torch.equal(out[f"layers.{i}.{mix}.normed_streams"], streams(normed))
            assert torch.allclose(out[f"layers.{i}.{mix}.mix_weights"], streams(weights), atol=1e-6)
            assert torch.allclose((out[f"layers.{i}.{mix}.mix_weights"] * streams(normed)).mean(-2), mixed, atol=1e-6)
        assert torch.equal(out[f"layers.{i}.layer_mid"], streams(seen[f"{i}.mlp_mix"][0]))
    assert torch.equal(out["layers.2.ple.ple_output"], streams(seen["2.ple"][1]))
    assert "layers.0.ple.ple_output" not in ig.values  # only the blocks of ple_layer_ids carry one
    assert torch.equal(out["final_norm_output"], seen["final_mix"][1])
    assert torch.equal(out["final_mix.mixed_input"], seen["final_mix"][1])
    head = model.lm_head.weight
    assert torch.allclose(out["final_norm_output"] @ head.T, logits, atol=1e-5)


def test_ngram_embeddings_equal_the_hook_and_each_orders_hash(loaded):
    """The PLE layer's n-gram embeddings, apart per order and hash head: the embedding module's output (a hook), and
    its arithmetic from its buffers and table: the ``order`` tokens ending at a token (eos before the prompt, and
    before an eos among them: a new segment) times the order's multipliers, xor-ed, modulo each head's prime, past
    its offset, a row of the table."""
    model, ig = loaded
    ids, mask = padded()
    ids[0, 20] = eos = model.config.eos_token_id  # an eos inside a prompt (and row 1's pads are eos too)
    out, (_, seen) = ig(ids, mask), hooked(model, ids, mask)
    values = out["layers.2.ple.ngram_embeddings"]
    assert values.shape == (3, 37, 2, 2, 16)  # orders 2 and 3, 2 heads each, 16 wide
    assert torch.equal(values.flatten(-3), seen["2.ngrams"][1])
    assert "layers.0.ple.ngram_embeddings" not in ig.values
    embedding = model.model.layers[2].ple.ple_embedding
    multipliers, primes, offsets = (buffer.tolist() for buffer in (
        embedding.layer_multipliers, embedding.ngram_heads_vocab_sizes, embedding.ngram_heads_offsets))
    for row, token in ((0, 0), (0, 1), (0, 20), (0, 21), (0, 22), (0, 36), (1, 9), (1, 10)):
        tokens = ids[row].tolist()
        for order in (2, 3):
            hashed = 0
            for shift in range(order):
                source = token - shift
                seen = tokens[source] if source >= 0 and eos not in tokens[source:token] else eos
                hashed ^= seen * multipliers[shift]
            for head in range(2):
                index = (order - 2) * 2 + head
                expected = embedding.ngram_embedding.weight[hashed % primes[index] + offsets[index]]
                assert torch.equal(values[row, token, order - 2, head], expected), (row, token, order, head)


def test_selection_values_equal_the_loop_and_the_indexer_arithmetic(loaded):
    model, ig = loaded
    ids, mask = padded()
    out, (_, seen) = ig(ids, mask), hooked(model, ids, mask)
    for i in (1, 3):
        selected = out[f"layers.{i}.self_attn.selected_tokens"]
        assert selected.dtype == torch.bool and torch.equal(selected, seen[f"{i}.indexer"][1][:, 0])
        # kept: per query min(visible, budget + the tail); a padded query keeps nothing
        assert int(selected[0, -1].sum()) == 8 + 37 % 4 and not selected[2, :30].any()
    # block scores of row 1 (9 pads), query 20 by the loop's arithmetic: its 12 keys make 3 blocks
    indexer, hidden = model.model.layers[1].self_attn.indexer, seen["1.attention_mix"][1][0]
    scores = out["layers.1.self_attn.block_scores"]
    assert scores.shape == (3, 37, 9) and torch.isinf(scores[1, 20, 3:]).all()
    q, k = indexer.index_qk_proj(hidden[1]).split([2 * 16, 16], dim=-1)
    q = indexer.q_layernorm(q.unflatten(-1, (2, 16)))
    cos, sin = model.model.rotary_emb(hidden, torch.arange(37).expand(3, 1, -1))
    rotate = lambda x, at: _rotary(x, cos[0, at], sin[0, at])  # noqa: E731
    q = rotate(q[20], 20)
    for block in range(3):
        first = 9 + 4 * block
        pooled = indexer.k_layernorm(k[first:first + 4].float().mean(0))
        expected = torch.relu(q @ rotate(pooled, first)).sum() / math.sqrt(16)
        assert torch.allclose(scores[1, 20, block], expected, atol=1e-5)


def _rotary(x, cos, sin):
    rot = cos.shape[-1]
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat([head * cos + torch.cat([-head[..., rot // 2:], head[..., :rot // 2]], -1) * sin, tail], -1)


def test_moe_and_mixer_values_equal_hooks(loaded):
    model, ig = loaded
    ids, mask = padded()
    out, (_, seen) = ig(ids, mask), hooked(model, ids, mask)
    for i in range(4):
        gate_in, (router_logits, _, indices) = seen[f"{i}.gate"]
        assert torch.equal(out[f"layers.{i}.mlp.router_logits"].flatten(0, 1), router_logits)
        assert torch.equal(out[f"layers.{i}.mlp.router_indices"].flatten(0, 1), indices)
        assert torch.equal(out[f"layers.{i}.mlp_input"], seen[f"{i}.mlp_mix"][1][0])
    deltanet = model.model.layers[0].linear_attn
    mixed = seen["0.attention_mix"][1][0] * mask[..., None]  # the DeltaNet zeroes padded tokens first
    assert torch.allclose(out["layers.0.linear_attn.betas"], deltanet.in_proj_b(mixed).sigmoid(), atol=1e-6)
    decays = -deltanet.A_log.float().exp() * torch.nn.functional.softplus(deltanet.in_proj_a(mixed).float()
                                                                           + deltanet.dt_bias)
    assert torch.allclose(out["layers.0.linear_attn.decays"], decays, atol=1e-6)
    gate = model.model.layers[1].self_attn.q_proj(seen["1.attention_mix"][1][0]).unflatten(-1, (4, 64))[..., 32:]
    assert torch.allclose(out["layers.1.self_attn.attention_gate"], gate, atol=1e-6)


def test_support_lists_the_new_values(loaded):
    model, ig = loaded
    table = qgraph.support(model)
    for name in ("layers.0.layer_input", "layers.1.attention_mix.mix_weights", "layers.1.mlp_mix.injection_weights",
                 "final_mix.mix_weights", "final_norm_output", "layers.2.ple.ple_output",
                 "layers.3.self_attn.selected_tokens", "layers.3.self_attn.block_scores",
                 "layers.0.linear_attn.states", "layers.0.mlp.router_weights"):
        assert table[name].available and (name in ig.values or table[name].by_name_only), name
    assert table["layers.1.attention_mix.mix_weights"].layout == "Streams [batch seq streams hidden_size]"


def test_the_image_text_model_with_an_image(tmp_path):
    """Qwen4ExpForConditionalGeneration (the tiny tower): logits, the selection (over M-RoPE positions) and the
    vision features as the HF forward computes them."""
    import numpy as np
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from qgraph.testing import load_processor, video_prompt
    path = tiny_qwen4_exp(tmp_path, images=True)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = load_processor(path)
    text = video_prompt(processor, videos=0, images=1, text="what is this?")  # a user turn with one image
    pixels = (np.random.default_rng(2).random((48, 80, 3)) * 255).astype("uint8")
    inputs = processor(text=text, images=[Image.fromarray(pixels)])
    ig = qgraph.instrument(model, values=["vision.image_features", "layers.1.self_attn.selected_tokens",
                                          "layers.0.layer_output"])
    out = ig(**inputs)
    seen = {}
    indexer = model.model.language_model.layers[1].self_attn.indexer
    handle = indexer.register_forward_hook(lambda module, args, output: seen.__setitem__("selected", output))
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
    finally:
        handle.remove()
    assert torch.equal(out.logits, logits)
    assert torch.equal(out["layers.1.self_attn.selected_tokens"], seen["selected"][:, 0])
    assert out["layers.0.layer_output"].shape == (*inputs["input_ids"].shape, 3, 64)
    assert int(inputs["input_ids"].shape[1]) > 12  # past the budget: the selection drops keys
    assert int(out["layers.1.self_attn.selected_tokens"][0, -1].sum()) < inputs["input_ids"].shape[1]


def test_deltanet_states_equal_the_float64_recurrence(models):
    """The DeltaNet values of the PLE block: its states after every token, its head outputs and its effective
    attention are the gated delta rule run in float64 over the program's own queries, keys, values, decays and
    betas (the effective attention: the rule run on one-hot values, token s's value the s-th unit vector, so the
    output at t is row t of the attention)."""
    model = models("eager")
    names = ("attention_queries", "attention_keys", "attention_values", "decays", "betas", "states",
             "attention_head_outputs", "state_output", "effective_attention")
    ig = qgraph.instrument(model, values=[f"layers.2.linear_attn.{name}" for name in names])
    ids, mask = padded()
    out = ig(ids, mask)
    q, k, v, g, beta, states, heads, final, attention = (out[f"layers.2.linear_attn.{name}"].double()
                                                         for name in names)
    q, k = ((x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(2, dim=2) for x in (q, k))
    q = q / math.sqrt(q.shape[-1])
    length = ids.shape[1]
    state = torch.zeros(*states.shape[:1], *states.shape[2:], dtype=torch.float64)
    unit = torch.zeros(*state.shape[:-1], length, dtype=torch.float64)  # the same rule over one-hot values
    for t in range(length):
        state, unit = (x * g[:, t].exp()[..., None, None] for x in (state, unit))
        write = (v[:, t] - (state * k[:, t, ..., None]).sum(-2)) * beta[:, t, :, None]
        state = state + k[:, t, ..., None] * write[..., None, :]
        one_hot = torch.nn.functional.one_hot(torch.tensor(t), length).double()
        unit = unit + k[:, t, ..., None] * ((one_hot - (unit * k[:, t, ..., None]).sum(-2)) * beta[:, t, :, None])[
            ..., None, :]
        assert torch.allclose(states[:, t], state, atol=1e-4)
        assert torch.allclose(heads[:, t], (state * q[:, t, ..., None]).sum(-2), atol=1e-4)
        torch.testing.assert_close(attention[:, :, t], (unit * q[:, t, ..., None]).sum(-2), rtol=1e-4, atol=1e-8)
    assert torch.allclose(final, state, atol=1e-4)
    assert attention[:, :, -1, :-1].abs().max() > 1e-4  # it attends to earlier tokens (random decays are fast)


def test_generate_runs_with_every_value_and_a_family_that_cannot_is_refused_by_name(loaded, monkeypatch):
    """These models generate (``tests/test_qwen4_generate.py`` checks the decoding against HF's), with every value
    captured at every step; a family that declares it cannot (``Family.not_generating``) is still refused by
    name, before any work."""
    model, ig = loaded
    ids = random_ids(1, 14, seed=9)
    out = ig.generate(ids, max_new_tokens=3)
    with torch.no_grad():
        assert torch.equal(out.sequences, model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                         max_new_tokens=3, do_sample=False))
    assert out.steps[3]["layers.3.self_attn.selected_tokens"].shape == (1, 1, 17)
    monkeypatch.setattr(ig, "family", replace(ig.family, not_generating="its cache is not carried"))
    with pytest.raises(qgraph.errors.NotSupported, match="qwen4_exp_text models yet: its cache is not carried"):
        ig.generate(torch.zeros(1, 5, dtype=torch.long), max_new_tokens=2)


def test_a_mask_whose_queries_see_other_keys_than_a_causal_one_is_refused():
    from qgraph.kernels.qsa import qsa_select
    causal = torch.ones(1, 6, 6, dtype=torch.bool).tril()
    scores = torch.zeros(1, 6, 3)
    assert not (qsa_select(scores, causal, 2, 1) & ~causal).any()  # a causal mask runs, keeping only what it sees
    window = causal & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)  # a sliding window: not a prefix of the row
    with pytest.raises(qgraph.errors.NotSupported, match="causal attention_mask"):
        qsa_select(scores, window, 2, 1)


def test_blocks_of_one_kind_repeat_one_traced_block(tmp_path, monkeypatch):
    """Two PLE blocks of one kind (0 and 2) and two QSA blocks (1 and 3): the export traces block 0, 1 and 2 (the
    second PLE's n-gram table differs in size, so it is a variant) and repeats block 1 for block 3. Block 2 reads
    a size block 0's PLE computed (export shares ``seq + 2``): it moves before the blocks, so the repeat holds,
    and the program's values equal the HF forward's."""
    from transformers import AutoModelForCausalLM

    from qgraph.export import trace
    repeated = []
    real = trace.repeat_blocks
    monkeypatch.setattr(trace, "repeat_blocks", lambda *args: repeated.append(real(*args)) or repeated[-1])
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen4_exp(tmp_path, ple_layer_ids=[1, 3])).eval()
    ig = qgraph.instrument(model, values=["layers.*.layer_output", "layers.0.ple.ple_output",
                                          "layers.2.ple.ple_output"])
    assert len(repeated) == 1 and repeated[0] is not None
    assert [entry.split(":")[0] for entry in ig.exported.apart] == ["model.layers.2.ple.ple_embedding.ngram_embedding"]
    ids, mask = padded()
    logits, seen = hooked(model, ids, mask)
    with torch.no_grad():
        out = ig(ids, attention_mask=mask)
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=1e-6)
    for i in range(4):
        assert torch.equal(out[f"layers.{i}.layer_output"].flatten(-2), seen[f"{i}.layer"][1])
    for i in (0, 2):
        assert torch.equal(out[f"layers.{i}.ple.ple_output"].flatten(-2), seen[f"{i}.ple"][1])


def test_a_transformers_that_selects_inside_the_indexers_forward_is_refused_by_name(loaded, monkeypatch):
    """transformers 5.23 and 5.24 select inside the indexer's forward (no ``_select_tokens`` to swap while exporting):
    instrumenting such a model is refused by name with the release that works, before any export."""
    model, _ = loaded
    indexer = type(model.model.layers[1].self_attn.indexer)
    monkeypatch.delattr(indexer, "_select_tokens")
    with pytest.raises(qgraph.UnsupportedModel, match=r"transformers \S+ selects the sparse attention's tokens inside "
                                                      r"the indexer's forward.*pip install 'transformers>=5.25'"):
        qgraph.instrument(model, values=["layers.0.layer_output"])
