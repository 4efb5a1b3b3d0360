"""Edits at Qwen3.8-Flash-Next's own values (issue 58, item 4) equal the HF forward edited by hand.

Each edit (one stream of the residual streams, a mix's weights, injection weights and mixed input, the
sparse attention's selection, the PLE layer's output, the final mix) runs on the tiny ``qwen4_exp``
checkpoint on a left-padded batch, and the HF forward runs with a forward hook, a forward pre-hook or a
patched method making the same change by hand: the logits and a value downstream of the edit are equal
bit for bit (the program runs the HF forward's own operations), and the edit moves the logits. The
gradient of a steering vector equals HF autograd through the hand-edited forward (float32 rounding:
the backward passes sum in other orders). The TransformerLens aliases resolve to the family's values;
``ln1.hook_normalized`` is refused with the nearest value named.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import qgraph
from conftest import hf_logits, random_ids

STREAMS, HIDDEN = 3, 64  # the tiny checkpoint's hc_count and hidden_size
VECTOR = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def models(qwen4_models):
    """The tiny model under ``"eager"`` (the default here: its attention pattern is a value) or ``"sdpa"``,
    shared with the other qwen4 test files (conftest's ``qwen4_models``)."""
    return lambda implementation="eager": qwen4_models(implementation)


@pytest.fixture(scope="module")
def batch():
    """Two prompts of 24 tokens, the second left-padded by 5 (past the indexer's budget: QSA drops keys)."""
    ids, mask = random_ids(2, 24, seed=11), torch.ones(2, 24, dtype=torch.long)
    ids[1, :5], mask[1, :5] = 256, 0
    return ids, mask


@pytest.fixture(scope="module")
def ig(models):
    return qgraph.instrument(models(), values=["layers.*.layer_input", "layers.*.layer_mid", "layers.*.layer_output",
                                               "layers.*.attention_mix.*", "layers.3.self_attn.selected_tokens",
                                               "layers.3.self_attn.attention_probabilities", "final_norm_output"])


@pytest.fixture(scope="module")
def clean(ig, batch):
    return ig(*batch)


def on_copy(change):
    """``change`` (in place) of a copy of a tensor: the copy."""
    def edit(x):
        x = x.clone()
        change(x)
        return x
    return edit


def streamwise(change):
    """A change of a ``[... streams * hidden]`` tensor as ``change([... streams hidden])`` of a copy."""
    return lambda x: on_copy(change)(x.unflatten(-1, (STREAMS, HIDDEN))).flatten(-2)


def set_at(index, value):
    """``x[index] = value`` (in place, on the copy ``streamwise`` hands it)."""
    return lambda x: x.__setitem__(index, value)


def add_at(index, vector):
    return lambda x: x.__setitem__(index, x[index] + vector)


@contextlib.contextmanager
def hooked(*handles):
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def on_output(module, change):
    """A forward hook: the module returns ``change(output)``."""
    return module.register_forward_hook(lambda _, args, output: change(output))


def on_input(module, change):
    """A forward pre-hook: the module is called with ``change(first argument)``."""
    return module.register_forward_pre_hook(lambda _, args: (change(args[0]), *args[1:]))


def on_first(change):
    """A change of a tuple's first item (a block mix returns (mixed_input, streams, injection_weights))."""
    return lambda output: (change(output[0]), *output[1:])


def on_last(change):
    return lambda output: (*output[:-1], change(output[-1]))


def hand_edited(model, batch, *hooks):
    """The HF forward with ``hooks`` ((module, make_hook(module, change)), change) in place: (logits, the
    last block's output streams)."""
    seen = {}
    last = model.model.layers[-1].register_forward_hook(lambda _, args, output: seen.setdefault("out", output))
    with hooked(last, *(make(module, change) for module, make, change in hooks)):
        return hf_logits(model, *batch), seen["out"].unflatten(-1, (STREAMS, HIDDEN))


def layers(model):
    return model.model.layers


# name -> (edits, the same change by hand on the HF model: [(module of the model, hook maker, change)])
CASES = {
    "zero stream 1 of a block's output": (
        {"layers.0.layer_output": qgraph.Zero(streams=1)},
        lambda m: [(layers(m)[0], on_output, streamwise(set_at((..., 1, slice(None)), 0.0)))]),
    "add a vector to stream 0 at one position of a block's input (before its PLE layer)": (
        {"layers.2.layer_input": qgraph.Add(VECTOR, streams=0, positions=7)},
        lambda m: [(layers(m)[2], on_input, streamwise(add_at((slice(None), 7, 0), VECTOR)))]),
    "stream 2's injection weight zeroed: the mixer no longer writes into it": (
        {"layers.1.attention_mix.injection_weights": qgraph.Zero(streams=2)},
        lambda m: [(layers(m)[1].attn_hyper_connection, on_output, on_last(lambda w: w * torch.tensor([1., 1., 0.])))]),
    "the MLP's injection weights doubled on stream 0": (
        {"layers.2.mlp_mix.injection_weights": qgraph.Scale(2.0, streams=0)},
        lambda m: [(layers(m)[2].mlp_hyper_connection, on_output, on_last(lambda w: w * torch.tensor([2., 1., 1.])))]),
    # sigmoid(-inf) is 0 exactly: the mix weights of streams 1 and 2 zeroed before the mix's mean
    "the mixer reads stream 0 alone (mix weights of streams 1 and 2 zeroed)": (
        {"layers.3.attention_mix.mix_weights": qgraph.Zero(streams=[1, 2])},
        lambda m: [(layers(m)[3].attn_hyper_connection.input_mix_weight_up, on_output,
                    streamwise(set_at((..., [1, 2], slice(None)), -float("inf"))))]),
    "a vector added to what the mixer reads at the last position": (
        {"layers.3.attention_mix.mixed_input": qgraph.Add(VECTOR, positions=-1)},
        lambda m: [(layers(m)[3].attn_hyper_connection, on_output,
                    on_first(lambda x: torch.cat([x[:, :-1], x[:, -1:] + VECTOR], 1)))]),
    "the PLE layer's output on stream 1 zeroed": (
        {"layers.2.ple.ple_output": qgraph.Zero(streams=1)},
        lambda m: [(layers(m)[2].ple, on_output, streamwise(set_at((..., 1, slice(None)), 0.0)))]),
    "a vector added to the final mix's output at the last position": (
        {"final_mix.mixed_input": qgraph.Add(VECTOR, positions=-1)},
        lambda m: [(m.model.hyper_connection_mixer, on_output,
                    lambda x: torch.cat([x[:, :-1], x[:, -1:] + VECTOR], 1))]),
    "what lm_head reads doubled": (
        {"final_norm_output": qgraph.Scale(2.0)},
        lambda m: [(m.model.hyper_connection_mixer, on_output, lambda x: 2 * x)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_edit_equals_the_hand_edited_hf_forward(models, ig, clean, batch, case):
    edits, by_hand = CASES[case]
    model = models()
    out = ig(*batch, edits=edits)
    logits, last = hand_edited(model, batch, *by_hand(model))
    assert torch.equal(out.logits, logits)
    assert torch.equal(out["layers.3.layer_output"], last)
    assert not torch.equal(out.logits, clean.logits)  # the edit moves the logits


def test_edited_streams_are_captured_as_edited(ig, clean, batch):
    out = ig(*batch, edits={"layers.0.layer_output": qgraph.Zero(streams=1),
                            "layers.1.attention_mix.injection_weights": qgraph.Zero(streams=2),
                            "layers.3.attention_mix.mix_weights": qgraph.Zero(streams=[1, 2])})
    streams = out["layers.0.layer_output"]
    assert not streams[:, :, 1].any()
    assert torch.equal(streams[:, :, [0, 2]], clean["layers.0.layer_output"][:, :, [0, 2]])
    # the mixer of block 1 writes nothing into stream 2: it leaves the block's mixer part as it came in
    assert not out["layers.1.attention_mix.injection_weights"][..., 2].any()
    assert torch.equal(out["layers.1.layer_mid"][:, :, 2], out["layers.1.layer_input"][:, :, 2])
    assert not torch.equal(out["layers.1.layer_mid"][:, :, 0], out["layers.1.layer_input"][:, :, 0])
    # block 3's mixer reads stream 0 alone: its mixed input is stream 0's weighed normed stream over 3
    mix = {name: out[f"layers.3.attention_mix.{name}"] for name in ("mix_weights", "normed_streams", "mixed_input")}
    assert not mix["mix_weights"][:, :, 1:].any()
    torch.testing.assert_close(mix["mixed_input"], mix["mix_weights"][:, :, 0] * mix["normed_streams"][:, :, 0] / 3,
                               rtol=0, atol=1e-6)


def test_edits_at_a_blocks_output_and_the_next_blocks_input_chain_in_forward_order(models, ig, batch):
    """``layers.1.layer_output`` and ``layers.2.layer_input`` are one tensor: the output's edit applies first,
    the input's after it (whatever the order of the edits given), and each name is captured as edited so far."""
    model = models()
    output, given = qgraph.Zero(streams=1), qgraph.Add(VECTOR, streams=0, positions=7)
    for edits in ({"layers.1.layer_output": output, "layers.2.layer_input": given},
                  {"layers.2.layer_input": given, "layers.1.layer_output": output}):
        out = ig(*batch, edits=edits)
        logits, last = hand_edited(model, batch,
                                   (layers(model)[1], on_output, streamwise(set_at((..., 1, slice(None)), 0.0))),
                                   (layers(model)[2], on_input, streamwise(add_at((slice(None), 7, 0), VECTOR))))
        assert torch.equal(out.logits, logits) and torch.equal(out["layers.3.layer_output"], last)
        block_output, block_input = out["layers.1.layer_output"], out["layers.2.layer_input"]
        assert not block_output[:, :, 1].any() and not block_input[:, :, 1].any()
        assert torch.equal(block_input[:, 7, 0], block_output[:, 7, 0] + VECTOR)


def test_a_steering_vectors_gradient_equals_hf_autograd(models, ig, batch):
    """d loss / d v of v added to stream 0 of block 1's output at position 5: qgraph's program against HF
    autograd through a forward hook doing the same."""
    model = models()
    metric = lambda logits: logits[:, -1].logsumexp(-1).sum()  # noqa: E731
    vector = VECTOR.clone().requires_grad_()
    out = ig(*batch, edits={"layers.1.layer_output": qgraph.Add(vector, streams=0, positions=5)})
    grad, = torch.autograd.grad(metric(out.logits), vector)
    hf_vector = VECTOR.clone().requires_grad_()
    with hooked(on_output(layers(model)[1], streamwise(add_at((slice(None), 5, 0), hf_vector)))):
        logits = model(input_ids=batch[0], attention_mask=batch[1]).logits
    want, = torch.autograd.grad(metric(logits), hf_vector)
    assert grad.abs().sum() > 0
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


# -- the selection ----------------------------------------------------------------------------------------
def chosen_keys(selected: torch.Tensor, query: int) -> tuple[int, int]:
    """(a key row 0's ``query`` sees but its selection drops, a key of a complete block it keeps)."""
    row = selected[0, query]
    dropped = [k for k in range(query + 1) if not row[k]]
    kept = [k for k in range(query + 1 - (query + 1) % 4) if row[k]]  # not the incomplete tail
    return dropped[0], kept[0]


@contextlib.contextmanager
def selection_edited_by_hand(model, change):
    """Block 3's indexer returns ``change`` of the mask transformers' loop selects ([batch 1 query key])."""
    indexer = layers(model)[3].self_attn.indexer
    loop = indexer._select_tokens
    indexer._select_tokens = lambda *args, **kwargs: change(loop(*args, **kwargs))
    try:
        yield
    finally:
        del indexer._select_tokens


@pytest.mark.parametrize("implementation", ("eager", "sdpa"))
def test_a_key_forced_into_and_out_of_a_querys_selection(models, clean, batch, implementation):
    """Key ``k_in`` forced into the last query's selection with ``Replace(True, positions=, keys=)``, key ``k_out``
    forced out with a function of the mask, and every key selected (``Replace(True)``: dense attention where the
    causal mask allows): the attention reads exactly the edited mask (its probabilities are zero off it and
    positive on it), as the HF forward does with its selection patched to return it."""
    model = models(implementation)
    query, selected = 23, clean["layers.3.self_attn.selected_tokens"]
    k_in, k_out = chosen_keys(selected, query)
    values = ["layers.3.self_attn.selected_tokens", "layers.3.layer_output"]
    if implementation == "eager":  # (under sdpa the pattern would decompose the fused attention)
        values.append("layers.3.self_attn.attention_probabilities")
    ig = qgraph.instrument(model, values=values)
    unselect = torch.zeros_like(selected)
    unselect[0, query, k_out] = True
    cases = (  # (edit, the same change of the [batch 1 query key] mask transformers' loop selects)
        (qgraph.Replace(True, batch=0, positions=query, keys=k_in), set_at((0, 0, query, k_in), True)),
        (lambda mask: mask & ~unselect, set_at((0, 0, query, k_out), False)),
        (qgraph.Replace(True), lambda mask: mask.fill_(True)))
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    attention, seen = layers(model)[3].self_attn, {}
    for edit, change in cases:
        out = ig(*batch, edits={"layers.3.self_attn.selected_tokens": edit})
        seen.clear()
        by_hand = lambda mask, change=change: seen.setdefault("mask", on_copy(change)(mask))  # noqa: E731
        with selection_edited_by_hand(model, by_hand), hooked(
                attention.register_forward_hook(lambda _, args, output: seen.__setitem__("weights", output[1]))):
            logits, last = hand_edited(model, batch)
        edited = out["layers.3.self_attn.selected_tokens"]
        assert torch.equal(edited, seen["mask"][:, 0]) and int((edited != selected).sum()) >= 1
        assert torch.equal(out.logits, logits) and torch.equal(out["layers.3.layer_output"], last)
        assert not torch.equal(out.logits, clean.logits)
        if implementation == "eager":
            probabilities = out["layers.3.self_attn.attention_probabilities"]
            assert torch.equal(probabilities, seen["weights"])
            # row 0 (no pads) reads exactly the edited mask, as far as the causal mask lets it see
            assert torch.equal(probabilities[0] > 0, (edited[0] & causal).expand_as(probabilities[0]))


def test_a_selection_edit_of_the_wrong_kind_is_refused_by_name(ig, batch):
    name = "layers.3.self_attn.selected_tokens"
    refusals = {
        "the value is a bool mask, which has no sums": qgraph.Add(torch.ones(24)),
        "float32 but the value is a bool mask: give True or False": qgraph.Replace(1.0, keys=3),
        "its result is torch.float32 but the value is a bool mask": lambda mask: mask.float(),
        r"expected one broadcastable to \(2, 24, 24\)": qgraph.Replace(torch.ones(5, dtype=torch.bool)),
        "keys=.* out of range for its key axis of size 24": qgraph.Zero(keys=30),
    }
    for message, edit in refusals.items():
        with pytest.raises(qgraph.EditError, match=message):
            ig(*batch, edits={name: edit})
    with pytest.raises(qgraph.EditError, match=r"Scale\(streams=...\) at 'final_norm_output'.*has no streams axis"):
        ig(*batch, edits={"final_norm_output": qgraph.Scale(2.0, streams=0)})


def test_stream_and_key_selectors_and_a_masks_values_travel_to_a_server(ig, batch):
    """A remote call's edits as data (``serve.edits``): ``streams=``, ``keys=`` and True (a mask's, bool on the
    wire) come back as given, and edit as the local edit does."""
    from qgraph.serve.edits import decode, encode
    edits = {"layers.3.self_attn.selected_tokens": qgraph.Replace(True, batch=0, positions=23, keys=2),
             "layers.0.layer_output": qgraph.Add(VECTOR, streams=[0, 2], positions=4)}
    back = {}
    for i, (name, edit) in enumerate(edits.items()):
        spec, tensors = encode(name, edit, f"e{i}")
        back[name] = decode(name, spec, tensors, f"e{i}", set())
    assert back["layers.3.self_attn.selected_tokens"].tensor.dtype == torch.bool
    assert (back["layers.0.layer_output"].streams, back["layers.3.self_attn.selected_tokens"].keys) == ([0, 2], [2])
    assert torch.equal(ig(*batch, edits=back).logits, ig(*batch, edits=edits).logits)


# -- TransformerLens aliases ------------------------------------------------------------------------------
# alias -> the value it is on the tiny model (DeltaNet blocks 0 and 2, QSA attention blocks 1 and 3)
ALIASES = {
    "hook_embed": "token_embeddings",
    "blocks.1.hook_resid_pre": "layers.1.layer_input",  # the streams, [batch seq streams hidden_size]
    "blocks.1.hook_resid_mid": "layers.1.layer_mid",
    "blocks.1.hook_mlp_in": "layers.1.layer_mid",
    "blocks[-1].hook_resid_post": "layers.3.layer_output",
    "blocks.2.ln2.hook_normalized": "layers.2.mlp_input",  # what the MLP reads: the MLP mix's mixed input
    "blocks.2.mlp.hook_in": "layers.2.mlp_input",
    "blocks.0.hook_attn_out": "layers.0.linear_attn.attention_output",  # before each stream's injection weight
    "blocks.3.hook_attn_out": "layers.3.self_attn.attention_output",
    "blocks.0.attn.hook_z": "layers.0.linear_attn.attention_head_outputs",
    "blocks.3.attn.hook_z": "layers.3.self_attn.attention_head_outputs",
    "blocks.3.attn.hook_attn_scores": "layers.3.self_attn.attention_scores",
    "blocks.3.attn.hook_pattern": "layers.3.self_attn.attention_probabilities",  # over the selected keys
    "blocks.2.attn.hook_pattern": "layers.2.linear_attn.effective_attention",
    "blocks.1.hook_mlp_out": "layers.1.mlp.mlp_output",
    "blocks.1.mlp.hook_out": "layers.1.mlp.mlp_output",
}


def test_the_aliases_are_the_familys_values(models, batch):
    model = models()
    aliased = qgraph.instrument(model, values=list(ALIASES))
    assert aliased.values == list(dict.fromkeys(ALIASES.values()))
    out = aliased(*batch)
    plain = qgraph.instrument(model, values=list(ALIASES.values()))(*batch)
    for alias, name in ALIASES.items():
        assert out[alias] is out[name] and torch.equal(out[name], plain[name]), alias
    assert out["blocks.1.hook_resid_pre"].shape == (2, 24, STREAMS, HIDDEN)
    assert torch.equal(out["blocks.2.ln2.hook_normalized"], out["layers.2.mlp_input"])
    seen: dict = {}
    with hooked(on_input(layers(model)[1], lambda x: seen.setdefault("streams", x))):
        hf_logits(model, *batch)
    assert torch.equal(out["blocks.1.hook_resid_pre"], seen["streams"].unflatten(-1, (STREAMS, HIDDEN)))
    assert aliased.resolve("blocks.*.hook_resid_post") == [f"layers.{i}.layer_output" for i in range(4)]


def test_an_edit_by_alias_is_the_edit_by_standard_name(ig, batch):
    by_alias = ig(*batch, edits={"blocks.1.hook_resid_post": qgraph.Zero(streams=1)})
    by_name = ig(*batch, edits={"layers.1.layer_output": qgraph.Zero(streams=1)})
    assert torch.equal(by_alias.logits, by_name.logits) and not by_alias["layers.1.layer_output"][:, :, 1].any()


def test_ln1_hook_normalized_is_refused_with_the_nearest_value(ig):
    for alias in ("blocks.1.ln1.hook_normalized", "blocks.*.ln1.hook_normalized"):
        with pytest.raises(qgraph.errors.UnknownValue, match=r"no input_layernorm: the nearest value is "
                                                             r"layers\.[1*]\.attention_mix\.mixed_input"):
            ig.resolve(alias)
    with pytest.raises(qgraph.errors.UnknownValue, match="experts_neurons"):  # the MoE block's, as Qwen3.5-MoE's
        ig.resolve("blocks.1.mlp.hook_post")
