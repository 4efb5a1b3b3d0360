"""Names people bring (issue 28, item 7): TransformerLens hook names and HF module paths as aliases
of the standard values, in values=, edits= (declared and per call), saes= and out[...]; each is one
value, and the values are reported under the standard names."""
from __future__ import annotations

import pytest
import torch

import qgraph
from conftest import hooked_blocks
from qgraph.capture.read import saelens_name
from qgraph.families import QWEN3_5
from qgraph.saes import SAE
from qgraph.saes.fixtures import write_saelens
from qgraph.saes.formats import saelens_hook
from qgraph.saes.transcoder_formats import hooks_read, hooks_written, reads_of
from qgraph.values.aliases import tl_names, tl_value
from qgraph.values.names import standard

# alias -> the standard value it means on the tiny model (DeltaNet blocks 0-2, attention block 3)
ALIASES = {
    "hook_embed": "token_embeddings",
    "blocks.0.hook_resid_pre": "layers.0.layer_input",
    "blocks.2.hook_resid_mid": "layers.2.layer_mid",
    "blocks.1.hook_resid_post": "layers.1.layer_output",
    "blocks[-1].hook_resid_pre": "layers.3.layer_input",
    "blocks.1.hook_attn_out": "layers.1.linear_attn.attention_output",
    "blocks.3.hook_attn_out": "layers.3.self_attn.attention_output",
    "blocks.0.attn.hook_z": "layers.0.linear_attn.attention_head_outputs",
    "blocks.3.attn.hook_z": "layers.3.self_attn.attention_head_outputs",
    "blocks.3.attn.hook_attn_scores": "layers.3.self_attn.attention_scores",
    "blocks.3.attn.hook_pattern": "layers.3.self_attn.attention_probabilities",
    "blocks.2.hook_mlp_out": "layers.2.mlp.mlp_output",
    "blocks.3.ln1.hook_normalized": "layers.3.attention_norm_output",
    "blocks.1.hook_mlp_in": "layers.1.layer_mid",  # the transcoders' hooks around the MLP
    "blocks.0.ln2.hook_normalized": "layers.0.mlp_input",
    "blocks.1.mlp.hook_in": "layers.1.mlp_input",
    "blocks.0.mlp.hook_out": "layers.0.mlp.mlp_output",
    "blocks.2.mlp.hook_post": "layers.2.mlp.mlp_neurons",
    "model.layers.3.mlp.output": "layers.3.mlp.output",
    "model.language_model.layers.3.self_attn.attention_probabilities": "layers.3.self_attn.attention_probabilities",
    "model.language_model.layers[1].linear_attn.decays": "layers.1.linear_attn.decays",
}


@pytest.fixture(scope="module")
def sae(sdpa_model, tmp_path_factory):
    path = write_saelens(tmp_path_factory.mktemp("sae"), d_in=sdpa_model.config.hidden_size, d_sae=64,
                         architecture="topk", k=4, hook_name="blocks.1.hook_resid_post", seed=7)
    return SAE.load(path)


@pytest.fixture(scope="module")
def aliased(sdpa_model, sae):
    """One instrument whose values, declared edit slot and SAE are all given by aliases."""
    return qgraph.instrument(sdpa_model, values=[*ALIASES, "layers.1.sae.features"], edits=["blocks.1.hook_attn_out"],
                             saes={"blocks.1.hook_resid_post": sae})


@pytest.fixture(scope="module")
def aliased_out(aliased, ids):
    return aliased(input_ids=ids, attention_mask=torch.ones_like(ids))


def test_aliases_are_reported_under_the_standard_names(aliased):
    assert aliased.values == [*dict.fromkeys(ALIASES.values()), "layers.1.sae.features"]
    assert list(aliased.slots) == ["layers.1.linear_attn.attention_output"]
    assert list(aliased.saes) == ["layers.1.layer_output"]


@pytest.mark.parametrize("alias", list(ALIASES))
def test_an_alias_is_the_standard_value(aliased_out, out, alias):
    name = ALIASES[alias]
    assert torch.equal(aliased_out[name], out[name])
    assert aliased_out[alias] is aliased_out[name] and alias in aliased_out  # out[...] reads aliases too


def test_resid_aliases_equal_hf_hooks(sdpa_model, ids, aliased_out):
    mid = {}
    handle = sdpa_model.model.layers[2].post_attention_layernorm.register_forward_pre_hook(
        lambda module, args: mid.setdefault("x", args[0].clone()))
    try:
        _, blocks = hooked_blocks(sdpa_model, ids, {0: lambda o: o.clone(), 1: lambda o: o.clone(), 2: lambda o: o.clone()})
    finally:
        handle.remove()
    torch.testing.assert_close(aliased_out["blocks.1.hook_resid_post"], blocks[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(aliased_out["blocks[-1].hook_resid_pre"], blocks[2], rtol=0, atol=1e-5)
    torch.testing.assert_close(aliased_out["blocks.2.hook_resid_mid"], mid["x"], rtol=0, atol=1e-5)


def test_an_sae_given_by_its_hook_name_splices_at_the_standard_value(aliased_out, sae):
    features = aliased_out["layers.1.sae.features"]
    torch.testing.assert_close(features, sae.encode(aliased_out["layers.1.layer_output"]), rtol=0, atol=1e-6)
    assert features.abs().sum() > 0


def test_edits_by_alias_equal_edits_by_standard_name(ig, aliased, aliased_out, ids, out):
    by_standard = ig(ids, edits={"layers.3.layer_output": qgraph.Zero(positions=[-1]),
                                 "layers.1.linear_attn.attention_output": qgraph.Scale(2.0)})
    by_alias = ig(ids, edits={"blocks.3.hook_resid_post": qgraph.Zero(positions=[-1]),
                              "blocks.1.hook_attn_out": qgraph.Scale(2.0)})
    assert not torch.allclose(by_standard.logits, out.logits)
    assert torch.equal(by_alias.logits, by_standard.logits)
    assert torch.equal(by_alias["blocks.2.hook_resid_pre"], by_standard["layers.2.layer_input"])
    declared = aliased(ids, edits={"blocks.1.hook_attn_out": qgraph.Scale(2.0)})  # the slot declared by alias
    torch.testing.assert_close(declared["layers.1.linear_attn.attention_output"],
                               2 * aliased_out["layers.1.linear_attn.attention_output"], rtol=0, atol=0)
    assert torch.equal(declared["layers.2.layer_mid"], by_standard["layers.2.layer_mid"])


def test_globs_over_aliases_select_every_blocks_value(ig):
    assert ig.resolve("blocks.*.hook_resid_post") == [f"layers.{i}.layer_output" for i in range(4)]
    assert ig.resolve("blocks.*.hook_attn_out") == [*(f"layers.{i}.linear_attn.attention_output" for i in range(3)),
                                                    "layers.3.self_attn.attention_output"]
    assert ig.resolve("blocks.*.attn.hook_pattern") == [*(f"layers.{i}.linear_attn.effective_attention" for i in range(3)),
                                                        "layers.3.self_attn.attention_probabilities"]


def test_hf_module_paths_are_the_spec_names(ig):
    assert ig.resolve("model.layers.3.mlp.output") == ["layers.3.mlp.output"]
    assert ig.resolve("model.language_model.layers.3.self_attn.attention_probabilities") == [
        "layers.3.self_attn.attention_probabilities"]
    assert ig.resolve("model.language_model.layers.*.mlp.down_proj.input") == [
        f"layers.{i}.mlp.down_proj.input" for i in range(4)]


def test_scores_on_a_deltanet_block_say_what_the_block_has(ig, ids):
    assert ig.resolve("blocks.0.attn.hook_pattern") == ["layers.0.linear_attn.effective_attention"]
    with pytest.raises(qgraph.UnknownValue) as error:
        ig.resolve("blocks.0.attn.hook_attn_scores")
    message = str(error.value)
    assert "block 0 is a gated DeltaNet" in message
    assert "decays" in message and "states" in message and "[3]" in message
    with pytest.raises(qgraph.UnknownValue, match="gated DeltaNet"):
        ig(ids, edits={"blocks.1.attn.hook_attn_scores": qgraph.Zero()})


def test_unknown_hooks_and_blocks_are_named(ig):
    with pytest.raises(qgraph.UnknownValue, match="no block 4"):
        ig.resolve("blocks.4.hook_resid_post")
    with pytest.raises(qgraph.UnknownValue, match=r"blocks\.\{i\}\.hook_resid_post"):
        ig.resolve("blocks.3.hook_resid_posts")


def test_every_reader_reads_a_hook_as_the_model_does(ig):
    """One table (the family's): every hook an SAE, transcoder or CLT file may name is the value that
    values.names.standard reads it as on the tiny model, and every name a capture writes reads back."""
    family, config = ig.family, ig.config
    read = 0
    for template in family.aliases:
        for block in range(4) if "{i}" in template else [None]:
            hook = template.format(i=block)
            value = tl_value(hook)
            if block is not None:
                assert saelens_hook(hook) == value
                assert tl_value(template.removeprefix("blocks.{i}."), block=block) == value
            if value is not None:  # None: a mixer's, which the model's config picks
                assert standard(hook, family, config) == [value], hook
                read += 1
    assert read == 1 + 4 * 10  # hook_embed, and every block hook but the mixers' (attn_out, z, scores, pattern)
    assert tl_value("blocks.3.hook_attn_out") is None and tl_value("hook_mlp_in", block=3) == "layers.3.layer_mid"
    assert hooks_read() == ["ln2.hook_normalized", "mlp.hook_in", "hook_resid_mid", "hook_mlp_in"]
    assert hooks_written() == ["hook_mlp_out", "mlp.hook_out"]
    for hook in [*hooks_read(), *hooks_written()]:
        meant = standard(f"blocks.2.{hook}", family, config)
        assert meant == [f"layers.2.{reads_of(hook) or 'mlp.mlp_output'}"], hook
    assert {reads_of(hook) for hook in hooks_read()} == {"mlp_input", "layer_mid"}
    written = {name: saelens_name(name) for name in ig.catalogue if saelens_name(name) != name}
    for name, hook in written.items():
        assert standard(hook, family, config) == [name] and tl_names(name)[0] == hook
    assert written["layers.2.mlp_input"] == "blocks.2.ln2.hook_normalized"
    assert written["layers.2.layer_mid"] == "blocks.2.hook_resid_mid" and written["token_embeddings"] == "hook_embed"
    assert written["layers.3.self_attn.attention_output"] == "blocks.3.hook_attn_out"
    assert len(written) == 1 + 4 * 8 + 3 * 2 + 1 * 3  # embed; 8 per block (its mixer's output too); DeltaNet: 2, attention: 3
    with pytest.raises(qgraph.InvalidArgument, match="hook of block 3, not of block=2"):
        tl_value("blocks.3.hook_mlp_in", block=2)


def test_a_hook_added_to_the_familys_table_is_read_by_every_reader(monkeypatch):
    """The readers hold no table of their own: a name added to the family's is read by each of them."""
    monkeypatch.setitem(QWEN3_5.aliases, "blocks.{i}.mlp.hook_test_in", {"layer": "mlp_input"})
    monkeypatch.setitem(QWEN3_5.aliases, "blocks.{i}.ln2.hook_test", {"layer": "mlp_norm_output"})
    assert reads_of("mlp.hook_test_in") == "mlp_input" and "mlp.hook_test_in" in hooks_read()
    assert saelens_hook("blocks.5.mlp.hook_test_in") == "layers.5.mlp_input"
    assert saelens_hook("blocks.5.ln2.hook_test") == "layers.5.mlp_norm_output"
    assert saelens_name("layers.5.mlp_norm_output") == "blocks.5.ln2.hook_test"
    assert saelens_name("layers.5.mlp_input") == "blocks.5.ln2.hook_normalized"  # a value's first name is written


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_hook_post_on_a_moe_block_names_the_way_out_and_the_way_out_works(sparse_model, name):
    """The dense MLP's ``mlp.hook_post`` has no one value on the MoE block: the refusal names the block's
    neurons instead, and those names are values that capture what forward hooks see."""
    model = sparse_model(name)
    with pytest.raises(qgraph.UnknownValue) as refused:
        qgraph.instrument(model, values=["blocks.1.mlp.hook_post"])
    message = str(refused.value)
    assert "mlp_neurons" in message and "do not have" in message  # the problem
    assert "layers.1.mlp.experts_neurons" in message and "layers.1.mlp.shared_expert.mlp_neurons" in message
    assert "blocks.1.hook_mlp_out" in message and "layers.1.mlp.mlp_output" in message
    with pytest.raises(qgraph.UnknownValue, match=r"layers\.\*\.mlp\.experts_neurons"):  # a glob: the glob's names
        qgraph.instrument(model, values=["blocks.*.mlp.hook_post"])

    ig = qgraph.instrument(model, values=["layers.1.mlp.experts_neurons", "layers.1.mlp.shared_expert.mlp_neurons"],
                           logits=False)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    seen = {}
    handle = model.model.layers[1].mlp.shared_expert.down_proj.register_forward_hook(
        lambda module, args, output: seen.update(neurons=args[0]))  # returns None: the output stays
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        handle.remove()
    out = ig(ids)
    neurons = seen["neurons"].reshape(1, 6, -1)  # the HF block runs its shared expert on the tokens flattened
    torch.testing.assert_close(out["layers.1.mlp.shared_expert.mlp_neurons"], neurons, rtol=1e-6, atol=1e-6)
    text = model.config.get_text_config()
    assert out["layers.1.mlp.experts_neurons"].shape == (1, 6, text.num_experts_per_tok, text.moe_intermediate_size)
