"""The rule vocabulary's registries and traits: one locator per rule type (``values.locate``), one
derivation per ``Derived`` rule's ``how`` (``values.derive``), and the traits the catalogue reads."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from qgraph.families import FAMILIES
from qgraph.families.rules import (ConvContext, DeltaRule, DeltaRuleReads, DeltaRuleStates, DeltaRuleWrites, Derived,
                                   PaddedContext, Port, ProgramInput, ProgramOutput, Routing, Rule, SAEPart)
from qgraph.values.locate import LOCATORS, Locator, Missing
from qgraph.values import derive


def _specs():
    return [spec for family in FAMILIES for spec in family.values]


def test_every_family_rule_type_has_a_locator():
    kinds = {type(spec.rule) for spec in _specs()}
    assert {Port, DeltaRule, DeltaRuleStates, ConvContext, Routing, ProgramInput, ProgramOutput, Derived} <= kinds
    assert all(issubclass(kind, Rule) for kind in kinds)
    assert not [kind.__name__ for kind in kinds if kind not in LOCATORS]


def test_every_rule_type_but_saes_has_a_locator():
    # SAE values are made by values.dictionaries, never located
    assert {kind for kind in Rule.__subclasses__() if kind is not SAEPart} == set(LOCATORS)


def test_every_derived_rule_names_a_registered_derivation():
    hows = {spec.rule.how for spec in _specs() if isinstance(spec.rule, Derived)}
    assert {"last_position_softmax", "size"} <= hows
    assert not hows - set(derive.DERIVATIONS)
    for name, function in derive.DERIVATIONS.items():  # saved programs store the function's name
        assert function.__name__ == name and getattr(derive, name) is function


def _empty_locator():
    return Locator(torch.fx.Graph(), FAMILIES[0], None)


def test_locate_refuses_an_unregistered_rule_type():
    @dataclass(frozen=True)
    class Unregistered(Rule):
        part: str

    with pytest.raises(TypeError, match=r"Unregistered.*@locates\(Unregistered\)"):
        _empty_locator().locate("", Unregistered("x"))


def test_locate_dispatches_on_the_rule_type():
    locator = _empty_locator()
    assert locator.locate("layers.0", Derived(("logits",), "size")) == Missing("derived after the run")
    assert locator.locate("", ProgramInput("input_ids")) == Missing("the program takes no input 'input_ids'")
    assert "no gated delta-rule kernel" in locator.locate("layers.0.linear_attn", DeltaRule("queries")).reason


def test_traits_on_the_rule_classes():
    assert [rule.read_only for rule in (Routing("indices"), Routing("logits"), SAEPart("error"), SAEPart("features"),
                                        ProgramInput("x"), DeltaRuleStates(True), ConvContext("input"),
                                        Port("", "output"), Derived((), "size"))] == \
        [True, False, True, False, True, True, False, False, True]
    assert {kind for kind in Rule.__subclasses__() if kind.by_name_only} == {DeltaRuleStates, ConvContext,
                                                                             DeltaRuleReads, DeltaRuleWrites,
                                                                             PaddedContext}
    assert {kind for kind in Rule.__subclasses__() if kind.region_edits_only} == {DeltaRuleWrites}
    assert [DeltaRuleReads("attention").read_only, DeltaRuleReads("initial_state").read_only] == [False, True]
    assert {kind for kind in Rule.__subclasses__() if kind.derived} == {Derived}
    assert repr(Routing("indices")) == "Routing(part='indices')"  # reprs (and equality) stay the dataclasses'
    with pytest.raises(AttributeError):
        Routing("indices").part = "logits"


# What Entry.read_only / by_name_only / derived gave on the tiny model before the traits moved onto the rules
READ_ONLY = ["next_token_probs", "input_ids", "attention_mask", "input_size",
             *(f"layers.{i}.linear_attn.{name}" for i in range(3) for name in ("states", "state", "initial_state_output"))]
BY_NAME_ONLY = [f"layers.{i}.linear_attn.{name}" for i in range(3)
                for name in ("states", "state", "conv_state_input", "conv_state_output", "effective_attention",
                             "initial_state_output", "write_values")]
DERIVED = ["next_token_probs", "input_size"]


def test_catalogue_traits_are_unchanged(ig):
    catalogue = ig.catalogue
    assert len(READ_ONLY) == 13
    assert sorted(name for name, entry in catalogue.items() if entry.read_only) == sorted(READ_ONLY)
    assert sorted(name for name, entry in catalogue.items() if entry.by_name_only) == sorted(BY_NAME_ONLY)
    assert sorted(name for name, entry in catalogue.items() if entry.derived) == sorted(DERIVED)


def test_fill_computes_what_has_its_sources_and_skips_the_rest():
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(10).reshape(2, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    inputs = {"input_ids": ids, "attention_mask": mask}
    captured = {"logits": logits, "input_ids": ids, "nothing": None}
    derive.fill(captured, {"probs": ("last_position_softmax", ["logits"]), "input_size": ("size", ("input_ids",)),
                           "absent": ("size", ["not_captured"]), "empty": ("size", ["nothing"]),
                           "half": ("per_image_scores", ["logits", "not_captured"])}, inputs, None)
    assert set(captured) == {"logits", "input_ids", "nothing", "probs", "input_size"}
    expected = derive.last_position_softmax(logits, inputs=inputs, config=None)
    assert torch.equal(captured["probs"], expected)
    assert torch.equal(expected[0], logits[0, 2].float().softmax(-1))  # the last position the mask keeps
    assert captured["input_size"] == torch.Size([2, 5])


def test_fill_refuses_an_unknown_derivation():
    with pytest.raises(ValueError, match=r"'value'.*'no_such'.*last_position_softmax"):
        derive.fill({"logits": torch.zeros(1)}, {"value": ("no_such", ["logits"])}, {}, None)
