"""The cheap check every call makes first (``qgraph.export.watch.ModelWatch``): it passes only a model whose
fingerprint is the one taken, so a call never runs a stale program (issue 56, item 2)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import qgraph
from qgraph.export import constants
from qgraph.export.fingerprint import fingerprint
from qgraph.export.watch import ModelWatch
from tests.conftest import hf_logits, random_ids


@pytest.fixture()
def model(checkpoint):
    """A load of its own: the tests change it."""
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture()
def reads(ig):
    """The plain values the export of the tiny model read (``ExportedModel.reads``)."""
    return ig.exported.reads


def _retype(module: torch.nn.Module) -> None:
    module.__class__ = type("Other", (type(module),), {})


CHANGES = {
    "a replaced submodule": lambda m: setattr(m.model.layers[3].mlp, "down_proj", torch.nn.Linear(
        m.model.layers[3].mlp.down_proj.in_features, m.model.layers[3].mlp.down_proj.out_features, bias=False)),
    "an untied lm_head": lambda m: setattr(m.lm_head, "weight", torch.nn.Parameter(m.lm_head.weight.detach() + 0.5)),
    "another dtype": lambda m: m.to(torch.float64),
    "one parameter's data of another dtype": lambda m: setattr(
        m.model.norm.weight, "data", m.model.norm.weight.data.double()),
    "one parameter's data of another shape": lambda m: setattr(
        m.model.norm.weight, "data", torch.ones(m.model.norm.weight.shape[0] + 1)),
    "a buffer of another dtype": lambda m: setattr(
        m.model.rotary_emb, "inv_freq", m.model.rotary_emb.inv_freq.double()),
    "a new submodule": lambda m: m.model.layers[0].add_module("extra", torch.nn.Linear(2, 2)),
    "a deleted parameter": lambda m: delattr(m.model.layers[1].mlp.up_proj, "weight"),
    "a norm's eps": lambda m: setattr(m.model.norm, "eps", 0.5),
    "an attention's scaling": lambda m: setattr(m.model.layers[3].self_attn, "scaling", 3.0),
    "a list the export read, changed in place": lambda m: m.model.rotary_emb.mrope_section.append(1),
    "a config field": lambda m: setattr(m.config, "output_hidden_states", True),
    "another attention implementation": lambda m: m.set_attn_implementation("eager"),
    "a module's class": lambda m: _retype(m.model.layers[2].mlp),
    "a replaced config": lambda m: setattr(m.model, "config", type(m.config)(**{
        **m.config.to_dict(), "output_hidden_states": True})),
}


@pytest.mark.parametrize("change", CHANGES)
def test_every_change_refresh_must_catch_fails_the_cheap_check(model, reads, change):
    watch = ModelWatch(model, reads)
    assert watch.unchanged() and watch.holds()
    CHANGES[change](model)
    assert not watch.unchanged()
    assert not watch.holds()  # and the fingerprint itself says so: the programs are rebuilt
    assert watch.fingerprint != fingerprint(model, reads)


def test_a_renamed_class_fails_the_cheap_check(model, reads):
    _retype(model.model.layers[2].mlp)  # a class of its own, so that no other model sees the rename
    watch = ModelWatch(model, reads)
    type(model.model.layers[2].mlp).__qualname__ = "Renamed"
    assert not watch.unchanged() and not watch.holds()


def test_every_value_the_export_baked_in_fails_the_cheap_check(model, reads):
    """Each plain value the export read, changed alone on any object that holds it (as the fingerprint's own
    test changes them), fails the cheap check."""
    from tests.test_reliability import another_value
    watch = ModelWatch(model, reads)
    objects = dict(constants.objects(model))
    changed = 0
    for path, attribute, _ in constants.current(model, reads):
        owner = objects[path]
        value = getattr(owner, attribute)
        try:
            setattr(owner, attribute, another_value(value))
        except (AttributeError, TypeError, ValueError):
            continue
        try:
            assert not watch.unchanged(), f"{path}.{attribute}"
            changed += 1
        finally:
            setattr(owner, attribute, value)
        assert watch.unchanged(), f"{path}.{attribute} set back"
    assert changed >= 30


def test_a_difference_the_fingerprint_ignores_keeps_the_programs(model, reads):
    """A parameter replaced by one like it: the cheap check sees a new object, the fingerprint is the same, so
    the programs stay (they read the model's parameters at each call) and the next check is cheap again."""
    watch = ModelWatch(model, reads)
    up = model.model.layers[1].mlp.up_proj
    up.weight = torch.nn.Parameter(up.weight.detach() * 2)
    assert not watch.unchanged()
    assert watch.holds()
    assert watch.unchanged()


def test_a_class_that_walks_its_children_its_own_way_is_always_fingerprinted(model, reads):
    class Walker(type(model.model.norm)):
        def named_modules(self, *args, **kwargs):
            return super().named_modules(*args, **kwargs)

    model.model.norm.__class__ = Walker
    watch = ModelWatch(model, reads)
    assert not watch.unchanged()  # no cheap check for it
    assert watch.holds()  # the fingerprint decides
    model.model.layers[0].input_layernorm.eps = 0.5
    assert not watch.holds()


def test_a_call_after_a_replaced_parameter_reads_it_without_a_rebuild(model):
    ig = qgraph.instrument(model, values=["layers.*.layer_output"])
    ids = random_ids(1, 6, seed=2)
    program = ig.program
    up = model.model.layers[1].mlp.up_proj
    up.weight = torch.nn.Parameter(up.weight.detach() * 2)
    with torch.no_grad():
        assert torch.equal(ig(ids).logits, hf_logits(model, ids))
    assert ig.program is program and ig._watch.unchanged()
    model.model.norm.eps = 0.5  # then a change the program baked in: rebuilt, and read
    with torch.no_grad():
        assert torch.equal(ig(ids).logits, hf_logits(model, ids))
    assert ig.program is not program
