"""The API around the values: names, globs, errors, the support table and the annotated tree."""
from __future__ import annotations

import re

import pytest
import torch

import qgraph

from conftest import random_ids

ROOT = ["logits", "token_embeddings", "final_norm_output", "lm_head_output", "next_token_probs",
        "input_ids", "attention_mask", "input_size"]
LAYER = ["layer_input", "attention_norm_output", "layer_mid", "mlp_norm_output", "mlp_input", "layer_output"]
DELTANET = ["attention_queries", "attention_keys", "attention_values", "decays", "betas", "state_input",
            "attention_head_outputs", "state_output", "attention_output"]
BY_NAME_ONLY = ["states", "state", "conv_state_input", "conv_state_output",  # they rewrite the block
                "effective_attention", "initial_state_output", "write_values"]
ATTENTION = ["attention_queries", "attention_keys", "attention_values", "attention_scores",
             "attention_probabilities", "attention_head_outputs", "attention_premix", "attention_output",
             "attention_gate"]
MLP = ["mlp_activation", "mlp_neurons", "mlp_output"]
SCORES = {"layers.3.self_attn.attention_scores", "layers.3.self_attn.attention_probabilities"}


# -- names -----------------------------------------------------------------------------------------------
def test_bracket_and_negative_names(ig_eager, out_eager, eager_model):
    small = qgraph.instrument(eager_model, values=["layers[3].self_attn.attention_scores", "layers[-1].layer_output",
                                                   "model.layers[-4].mlp.mlp_output"])
    assert set(small.values) == {"layers.0.mlp.mlp_output", "layers.3.layer_output",
                                 "layers.3.self_attn.attention_scores"}
    ids = random_ids(2, 70, seed=1)
    got = small(input_ids=ids)
    assert set(got.values) == set(small.values)
    assert torch.equal(got["layers[3].self_attn.attention_scores"],
                       out_eager["layers.3.self_attn.attention_scores"])
    assert torch.equal(got["layers.3.layer_output"], out_eager["layers.3.layer_output"])
    assert torch.equal(got["layers.0.mlp.mlp_output"], out_eager["layers.0.mlp.mlp_output"])
    # the tapped values are the same numbers the full program gives, and logits are unchanged
    assert torch.equal(got.logits, out_eager.logits)


def test_negative_names_when_reading(eager_model, out_eager):
    """Reading a value back by the name it was asked for, negative index included."""
    small = qgraph.instrument(eager_model, values=["layers[-1].layer_output"])
    got = small(input_ids=random_ids(2, 70, seed=1))
    assert torch.equal(got["layers[-1].layer_output"], out_eager["layers.3.layer_output"])
    assert "layers[-1].layer_output" in got


def test_globs(ig, sdpa_model):
    layer_outputs = qgraph.instrument(sdpa_model, values=["layers.*.layer_output"]).values
    assert layer_outputs == [f"layers.{b}.layer_output" for b in range(4)]
    deltanet = qgraph.instrument(sdpa_model, values=["layers.*.linear_attn.*"]).values
    # one '*' is one dotted part: the standard values of the DeltaNets, not their submodules' ports
    assert set(deltanet) == {f"layers.{b}.linear_attn.{v}" for b in range(3) for v in DELTANET}
    # a glob selects the available values it matches and skips the others
    attention = qgraph.instrument(sdpa_model, values=["layers.3.self_attn.*"]).values
    unavailable = {name for name in ig.catalogue if not ig.catalogue[name].available}
    assert unavailable & {f"layers.3.self_attn.{v}" for v in ATTENTION} <= SCORES
    assert set(attention) == {f"layers.3.self_attn.{v}" for v in ATTENTION} - unavailable
    ports = qgraph.instrument(sdpa_model, values=["layers.3.self_attn.*.output"]).values
    assert set(ports) == {f"layers.3.self_attn.{m}.output" for m in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "q_norm", "k_norm")}
    # "**" selects everything available: every standard value of the issue, and the ports
    expected = set(ROOT) | {f"layers.{b}.{v}" for b in range(4) for v in LAYER} \
        | {f"layers.{b}.mlp.{v}" for b in range(4) for v in MLP} \
        | {f"layers.{b}.linear_attn.{v}" for b in range(3) for v in DELTANET} \
        | {f"layers.3.self_attn.{v}" for v in ATTENTION}
    expected -= unavailable
    standard = {name for name in ig.values if ig.catalogue[name].spec is not None}
    assert standard == expected


def test_logits_false(sdpa_model, out):
    small = qgraph.instrument(sdpa_model, values=["layers.1.layer_output"], logits=False)
    got = small(input_ids=random_ids(2, 70, seed=1))
    assert got.logits is None
    assert torch.equal(got["layers.1.layer_output"], out["layers.1.layer_output"])


# -- errors ------------------------------------------------------------------------------------------------
def test_unknown_name_lists_closest(sdpa_model):
    with pytest.raises(qgraph.UnknownValue) as error:
        qgraph.instrument(sdpa_model, values=["layers.3.self_attn.attention_scorez"])
    assert "layers.3.self_attn.attention_scores" in str(error.value)
    with pytest.raises(qgraph.UnknownValue) as error:
        qgraph.instrument(sdpa_model, values=["layers.1.layer_ouptut"])
    assert "layers.1.layer_output" in str(error.value)
    with pytest.raises(qgraph.UnknownValue) as error:
        qgraph.instrument(sdpa_model, values=["final_norm_outptu"])
    assert "final_norm_output" in str(error.value)


def test_unknown_glob(sdpa_model):
    with pytest.raises(qgraph.UnknownValue):
        qgraph.instrument(sdpa_model, values=["layers.*.no_such_value"])


def test_missing_block(sdpa_model):
    with pytest.raises(qgraph.UnknownValue, match=r"block"):
        qgraph.instrument(sdpa_model, values=["layers.9.layer_output"])


@pytest.mark.parametrize("block", [0, 1, 2, -2])
def test_self_attn_value_on_deltanet_block(sdpa_model, block):
    with pytest.raises(qgraph.UnknownValue) as error:
        qgraph.instrument(sdpa_model, values=[f"layers.{block}.self_attn.attention_gate"])
    message = str(error.value)
    assert "linear_attention" in message
    assert "linear_attn" in message  # what the block has instead
    assert "[3]" in message  # where self_attn is


def test_linear_attn_value_on_attention_block(sdpa_model):
    with pytest.raises(qgraph.UnknownValue, match="full_attention"):
        qgraph.instrument(sdpa_model, values=["layers.3.linear_attn.decays"])


def test_unsupported_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    for call in (lambda: qgraph.instrument(model, values=["logits"]), lambda: qgraph.support(model)):
        with pytest.raises(qgraph.UnsupportedModel) as error:
            call()
        message = str(error.value)
        assert "llama" in message.lower()  # what it got
        assert "qwen3_5_text" in message  # what is supported


@pytest.mark.parametrize("bad, match", [
    (lambda ids: {"input_ids": ids[0]}, r"\[batch, seq\]"),
    (lambda ids: {"input_ids": ids[..., None]}, r"\[batch, seq\]"),
    (lambda ids: {"input_ids": ids.float()}, r"integer"),
    (lambda ids: {"input_ids": ids, "attention_mask": torch.ones(2, 3, dtype=torch.long)}, r"attention_mask"),
    (lambda ids: {}, r"input_ids"),
])
def test_bad_inputs(ig, bad, match):
    ids = random_ids(2, 5)
    with pytest.raises((TypeError, ValueError), match=match):
        ig(**bad(ids))


def test_unexpected_inputs(ig):
    with pytest.raises(TypeError, match="pixel_values"):
        ig(input_ids=random_ids(1, 3), pixel_values=torch.zeros(1, 3, 8, 8))


def test_reading_an_uncaptured_value(sdpa_model):
    got = qgraph.instrument(sdpa_model, values=["layers.0.layer_output"])(input_ids=random_ids(1, 4))
    with pytest.raises(KeyError, match="layers.0.layer_output"):  # the message lists what was captured
        got["layers.1.layer_output"]


# -- the support table ---------------------------------------------------------------------------------------
def test_support_table_rows(sdpa_model):
    table = qgraph.support(sdpa_model)
    rows = {row.name: row for row in table.rows}
    expected = set(ROOT) | {f"layers.{{i}}.{v}" for v in LAYER} | {f"layers.{{i}}.mlp.{v}" for v in MLP} \
        | {f"layers.{{i}}.linear_attn.{v}" for v in [*DELTANET, *BY_NAME_ONLY]} \
        | {f"layers.{{i}}.self_attn.{v}" for v in ATTENTION}
    assert set(rows) == expected
    for row in table.rows:
        assert row.layout and row.description and row.shape
    # per block availability: None where available, the reason where not
    gate = rows["layers.{i}.self_attn.attention_gate"].blocks
    assert gate[3] is None
    for block in range(3):
        assert "linear_attention" in gate[block]
    decays = rows["layers.{i}.linear_attn.decays"].blocks
    assert [decays[b] is None for b in range(4)] == [True, True, True, False]
    assert "full_attention" in decays[3]
    assert all(reason is None for reason in rows["layers.{i}.layer_output"].blocks.values())
    for name in ("attention_scores", "attention_probabilities"):  # available, or says to load eager
        reason = rows[f"layers.{{i}}.self_attn.{name}"].blocks[3]
        assert reason is None or "eager" in reason
    assert rows["logits"].blocks == {None: None}


def test_support_table_layouts(sdpa_model):
    table = qgraph.support(sdpa_model)
    rows = {row.name: row for row in table.rows}
    expected = {
        "layers.{i}.self_attn.attention_queries": ("[batch num_heads seq qk_head_dim]", ("batch", 4, "seq", 32)),
        "layers.{i}.self_attn.attention_keys": ("[batch num_kv_heads seq qk_head_dim]", ("batch", 2, "seq", 32)),
        "layers.{i}.self_attn.attention_head_outputs": ("[batch seq num_heads head_dim]", ("batch", "seq", 4, 32)),
        "layers.{i}.self_attn.attention_gate": ("[batch seq num_heads head_dim]", ("batch", "seq", 4, 32)),
        "layers.{i}.self_attn.attention_scores": ("[batch num_heads query key]", ("batch", 4, "query", "key")),
        "layers.{i}.layer_output": ("[batch seq hidden_size]", ("batch", "seq", 64)),
        "logits": ("[batch seq vocab_size]", ("batch", "seq", 272)),
        "layers.{i}.mlp.mlp_neurons": ("[batch seq intermediate_size]", ("batch", "seq", 128)),
    }
    for name, (layout, shape) in expected.items():
        assert layout in rows[name].layout, name
        assert tuple(rows[name].shape) == shape, name


def test_support_shapes_match_captured(ig, out, ids):
    """Every standard value's table shape, with the call's sizes put in, is the captured tensor's."""
    batch, seq = ids.shape
    sizes = {"batch": batch, "seq": seq, "query": seq, "key": seq}
    for name in ig.values:
        entry = ig.catalogue[name]
        if entry.spec is None or name == "input_size":
            continue
        shape = tuple(sizes.get(dim, dim) for dim in entry.shape)
        assert tuple(out[name].shape) == shape, name


def test_support_table_lookup_and_text(sdpa_model):
    table = qgraph.support(sdpa_model)
    entry = table["layers[3].self_attn.attention_gate"]
    assert entry.available and entry.reason is None
    assert table["layers.3.self_attn.o_proj.input"].available  # ports too
    # a port of a module the forward never calls: the DeltaNet's act where it has one (transformers 5.9 to
    # 5.14 call conv1d as a module and F.silu, never act), else its conv1d (its weight passed to the kernel)
    unused = "act" if "act" in dict(sdpa_model.model.layers[0].linear_attn.named_children()) else "conv1d"
    conv = table[f"layers.0.linear_attn.{unused}.input"]
    assert not conv.available and conv.reason
    text = str(table)
    for row in table.rows:
        assert row.name in text
    line = next(l for l in text.splitlines() if l.startswith("layers.{i}.self_attn.attention_gate"))
    assert "3" in line and "linear_attention" in line


# -- ig.tree() ---------------------------------------------------------------------------------------------------
def _block(text: str, header: str) -> str:
    """The lines of the first module in ``text`` whose line contains ``header``, up to its closing paren."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if header in line)
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = next(i for i in range(start + 1, len(lines)) if lines[i] == " " * indent + ")")
    return "\n".join(lines[start:end + 1])


def test_printout(ig):
    text = ig.tree()
    assert text.startswith("Qwen3_5ForCausalLM(")
    attention = _block(text, "(self_attn): Qwen3_5Attention(")
    assert "(q_proj): Linear(in_features=64, out_features=256" in attention
    for value in ATTENTION:
        assert re.search(rf"\({value}\)\*? -> ", attention), value
    assert "(attention_gate)" in attention
    assert "(decays)" not in attention
    # what the sdpa load cannot give is marked, with the way to get it
    for name in SCORES:
        line = next(line for line in attention.splitlines() if f"({name.rsplit('.', 1)[1]})" in line)
        assert ("unavailable" in line and "eager" in line) == (not ig.catalogue[name].available), line
    deltanet = _block(text, "(linear_attn): Qwen3_5GatedDeltaNet(")
    for value in DELTANET:
        assert f"({value})" in deltanet, value
    assert "(attention_gate)" not in deltanet
    # each value is printed under its own host, once per host
    assert text.count("(attention_gate)") == 1
    assert text.count("(decays)") == 3
    assert text.count("(layer_output)") == 4
    assert text.count("(mlp_neurons)") == 4
    assert text.count("(next_token_probs)") == 1


def test_printout_marks_instrumented(sdpa_model):
    text = qgraph.instrument(sdpa_model, values=["layers.3.self_attn.attention_gate"]).tree()
    assert "(attention_gate)* -> " in text
    assert "(layer_output)* " not in text and "(layer_output) -> " in text
