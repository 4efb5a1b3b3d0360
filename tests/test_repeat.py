"""Exporting one block per kind and repeating it gives the graph a full export gives (qgraph.export.repeat)."""
from __future__ import annotations

import copy

import pytest
import torch

import qgraph
from qgraph.export import trace as export_module
from qgraph.export import TEXT_INPUTS, export_model
from qgraph.families import family_for
from qgraph.export.repeat import repeat_blocks, repeated_blocks
from qgraph.export.variants import split
from qgraph.testing import tiny_qwen3_5
from conftest import graph_structure, hf_logits, random_ids

LAYER_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 2


@pytest.fixture(scope="module")
def deep_checkpoint(tmp_path_factory):
    """The tiny model with 8 blocks (two of each seed kind's pattern)."""
    return tiny_qwen3_5(tmp_path_factory.mktemp("tiny-8"), num_hidden_layers=8, layer_types=LAYER_TYPES)


def _load(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def deep_model(deep_checkpoint):
    return _load(deep_checkpoint)


@pytest.fixture(scope="module")
def seed_and_full(deep_model):
    family = family_for(deep_model)
    (blocks,) = repeated_blocks(deep_model, family, images=False)
    seed, reads = export_module._export(deep_model, family, False, TEXT_INPUTS, [blocks])
    full, _ = export_module._export(deep_model, family, False, TEXT_INPUTS, [])
    return blocks, seed, full, reads


def test_the_seed_is_the_first_block_of_each_kind(deep_model):
    (blocks,) = repeated_blocks(deep_model, family_for(deep_model), images=False)
    assert blocks.path == "model.layers" and blocks.kinds == tuple(LAYER_TYPES) and blocks.seed == (0, 3)


def test_repeated_seed_is_the_full_export_node_for_node(deep_model, seed_and_full):
    blocks, seed, full, _ = seed_and_full
    assert len(seed.graph.nodes) < len(full.graph.nodes) * 0.4
    repeated = repeat_blocks(seed, deep_model, family_for(deep_model), blocks)
    assert graph_structure(repeated) == graph_structure(full)
    assert ([(s.kind, s.arg.name, s.target) for s in repeated.graph_signature.input_specs]
            == [(s.kind, s.arg.name, s.target) for s in full.graph_signature.input_specs])
    # the program reads the model's own tensors: no copy
    assert all(repeated.state_dict[name] is tensor for name, tensor in full.state_dict.items())


def test_exports_record_no_python_stack_and_leave_torchs_switch_as_it_was(seed_and_full):
    from torch.fx import config
    _, seed, full, _ = seed_and_full
    assert getattr(config, "do_not_emit_stack_traces", False) is False  # torch's default, put back after each
    if hasattr(config, "do_not_emit_stack_traces"):  # torch 2.10 has no switch: there each node has its stack
        stacks = [node.meta.get("stack_trace") or "" for graph in (seed.graph, full.graph) for node in graph.nodes]
        assert not [stack for stack in stacks if "modeling_qwen3_5" in stack]  # each op's line in the model's forward
    assert any(node.meta.get("nn_module_stack") for node in seed.graph.nodes)  # what qgraph finds nodes by


@pytest.mark.compat
def test_instrumented_deep_model_equals_hooks_and_hf(deep_model):
    ig = qgraph.instrument(deep_model, values=["layers.*.layer_output", "layers.5.linear_attn.decays",
                                               "layers.7.self_attn.attention_gate"])
    assert len(ig.exported.graph.nodes) > 1000  # the full 8-block program
    hooked = {}
    handles = [deep_model.model.layers[i].register_forward_hook(
        lambda module, args, output, i=i: hooked.__setitem__(i, output)) for i in range(8)]
    ids = random_ids(2, 70)
    try:
        reference = hf_logits(deep_model, ids)
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        out = ig(ids)
    assert torch.equal(out.logits, reference)
    for i in range(8):
        assert torch.equal(out[f"layers.{i}.layer_output"], hooked[i])
    assert out["layers.5.linear_attn.decays"].shape == (2, 70, deep_model.config.linear_num_value_heads)


def test_a_seed_that_does_not_repeat_falls_back_to_a_full_export(deep_model, seed_and_full, monkeypatch):
    blocks, seed, full, _ = seed_and_full
    family = family_for(deep_model)
    # a block that reads another block's inner value cannot be repeated
    graph = seed.graph
    marks = [node for node in graph.nodes if node.target is torch.ops.qgraph.mark.default]
    inner_of_block_0 = next(node for node in marks if node.args[1] == "layers.0.mlp.output")
    block_3_input = next(node for node in marks if node.args[1] == "layers.3.mlp.input")
    original = block_3_input.args
    with graph.inserting_before(block_3_input):
        cross = graph.call_function(torch.ops.aten.add.Tensor, (block_3_input.args[0], inner_of_block_0))
    cross.meta = dict(block_3_input.meta)
    block_3_input.args = (cross, *original[1:])
    try:
        assert repeat_blocks(seed, deep_model, family, blocks) is None
    finally:
        block_3_input.args = original
        graph.erase_node(cross)
    assert repeat_blocks(seed, deep_model, family, blocks) is not None

    # export_model then traces every block (the two exports stand in for torch.export here)
    traced = []
    monkeypatch.setattr(export_module, "_export", lambda model, family, images, names, blocks:
                        traced.append(blocks) or ((seed if blocks else full), frozenset()))
    monkeypatch.setattr(export_module, "repeat_blocks", lambda *args: None)
    exported = export_model(type(deep_model)(deep_model.config).eval())
    assert traced == [[blocks], []] and exported.program is full


# -- blocks that differ from their seed block (qgraph.export.variants) -------------------------------

def test_blocks_alike_in_what_the_trace_read_are_one_variant(deep_model, seed_and_full):
    blocks, _, _, reads = seed_and_full
    # every block's layer_idx differs, but the forward never reads it: no block is traced apart
    assert len({block.linear_attn.layer_idx if hasattr(block, "linear_attn") else block.self_attn.layer_idx
                for block in deep_model.model.layers}) == 8
    assert split(deep_model, blocks, reads) == blocks and split(deep_model, blocks, reads).seed == (0, 3)


# each value the trace bakes in, set apart on one block that is not its kind's first
UNLIKE_THEIR_SEED = {
    "model.layers.1.input_layernorm": ("eps", 0.1),
    "model.layers.6.post_attention_layernorm": ("eps", 0.3),
    "model.layers.5.linear_attn.norm": ("variance_epsilon", 1.0),  # the DeltaNet's gated norm
    "model.layers.7.self_attn": ("scaling", 0.5),
}


def _exports(monkeypatch) -> list:
    """Counts the torch.export traces that run from here on."""
    traced, export = [], torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: traced.append(1) or export(*args, **kwargs))
    return traced


@pytest.mark.compat
def test_blocks_unlike_their_seed_are_exported_apart_and_equal_hf(deep_checkpoint, monkeypatch):
    model, ids = _load(deep_checkpoint), random_ids(2, 70, seed=3)
    alike = hf_logits(model, ids)
    for path, (attribute, value) in UNLIKE_THEIR_SEED.items():
        module = model.get_submodule(path)
        before = getattr(module, attribute)
        setattr(module, attribute, value)
        assert not torch.allclose(hf_logits(model, ids), alike, atol=1e-4), f"{path}.{attribute} does not matter"
        setattr(module, attribute, before)
    for path, (attribute, value) in UNLIKE_THEIR_SEED.items():
        setattr(model.get_submodule(path), attribute, value)
    traced = _exports(monkeypatch)
    ig = qgraph.instrument(model, values=["layers.*.layer_output"])
    with torch.no_grad():
        out = ig(ids)
    torch.testing.assert_close(out.logits, hf_logits(model, ids), atol=1e-5, rtol=0)
    # the first trace tells which values the forward reads, the second holds the blocks unlike their seed
    assert len(traced) == 2
    apart = {line.split(":")[0]: line for line in ig.exported.apart}
    assert apart.keys() == UNLIKE_THEIR_SEED.keys()
    assert apart["model.layers.5.linear_attn.norm"] == ("model.layers.5.linear_attn.norm: variance_epsilon is 1.0 "
                                                       "where block 0's (its kind's first) is 1e-06")
    assert len(ig.exported.graph.nodes) > 1000  # still one program of every block


@pytest.mark.compat
def test_a_value_changed_after_instrument_is_noticed_at_the_next_call(deep_checkpoint, monkeypatch):
    model, ids = _load(deep_checkpoint), random_ids(2, 33, seed=4)
    traced = _exports(monkeypatch)
    ig = qgraph.instrument(model, values=["layers.2.layer_output"])
    assert len(traced) == 1 and ig.exported.apart == ()
    with torch.no_grad():
        torch.testing.assert_close(ig(ids).logits, hf_logits(model, ids), atol=1e-5, rtol=0)
    model.model.layers[7].self_attn.scaling = 0.5  # block 3 is the attention blocks' seed
    with torch.no_grad():
        out = ig(ids)
    torch.testing.assert_close(out.logits, hf_logits(model, ids), atol=1e-5, rtol=0)
    assert [line.split(":")[0] for line in ig.exported.apart] == ["model.layers.7.self_attn"]
    assert len(traced) == 2  # one trace for the rebuild: the last export's reads tell which blocks differ


@pytest.mark.compat
def test_an_moe_block_unlike_its_seed_is_exported_apart(sparse_model):
    model = copy.deepcopy(sparse_model("qwen3_5_moe"))  # the session's model is left as it is
    ids = random_ids(2, 20, seed=5)
    model.model.layers[2].mlp.gate.top_k += 1  # the router of one block picks one expert more
    ig = qgraph.instrument(model)
    with torch.no_grad():
        torch.testing.assert_close(ig(ids).logits, hf_logits(model, ids), atol=1e-5, rtol=0)
    assert [line.split(":")[0] for line in ig.exported.apart] == ["model.layers.2.mlp.gate"]
