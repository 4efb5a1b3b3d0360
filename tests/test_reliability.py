"""Edits anywhere, per call and per thread; programs never stale; the user's hooks never traced (issue 12)."""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

import qgraph
from qgraph import Add, EditError, Zero
from tests.conftest import hf_logits, random_ids


@pytest.fixture()
def fresh_model(checkpoint):
    """A load of its own, for tests that change the model."""
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def small_ids():
    return random_ids(2, 10, seed=5)


@pytest.fixture(scope="module")
def plain(sdpa_model):
    return qgraph.instrument(sdpa_model, values=["layers.*.layer_output"], edits=["layers.*.layer_output"])


def test_an_edit_at_an_undeclared_value_builds_its_program_once(plain, sdpa_model, small_ids):
    declared = qgraph.instrument(sdpa_model, values=["layers.*.layer_output"],
                                 edits=["layers.1.linear_attn.attention_output", "layers.2.mlp.mlp_output"])
    edits = {"layers.1.linear_attn.attention_output": Zero(), "layers.2.mlp.mlp_output": Zero(positions=[3])}
    with torch.no_grad():
        expected = declared(small_ids, edits=edits)
        got = plain(small_ids, edits=edits)
        programs = len(plain._programs)
        again = plain(small_ids, edits=edits)
        clean = plain(small_ids)
    assert torch.equal(got.logits, expected.logits)
    assert torch.equal(got["layers.3.layer_output"], expected["layers.3.layer_output"])
    assert torch.equal(again.logits, got.logits) and len(plain._programs) == programs  # built once
    assert torch.equal(clean.logits, hf_logits(sdpa_model, small_ids))  # and gone on the next call
    assert not torch.allclose(got.logits, clean.logits)


def test_skip_layers_per_call_on_a_program_without_its_slots(plain, small_ids):
    with torch.no_grad():
        out = plain(small_ids, edits=qgraph.skip_layers(1, 2))
    assert torch.allclose(out["layers.2.layer_output"], out["layers.0.layer_output"], atol=0, rtol=0)


def test_edits_at_read_only_or_derived_values_are_refused_per_call(plain, small_ids):
    with pytest.raises(EditError, match="read-only"):
        plain(small_ids, edits={"input_ids": Zero()})
    with pytest.raises(qgraph.UnknownValue):
        plain(small_ids, edits={"layers.1.no_such_value": Zero()})
    with pytest.raises(TypeError, match="dict"):
        plain(small_ids, edits=[Zero()])


def test_threads_never_see_each_others_edits(plain, sdpa_model, small_ids):
    with torch.no_grad():
        expected_plain = plain(small_ids).logits
        expected_edited = plain(small_ids, edits={"layers.1.layer_output": Zero()}).logits
    results, barrier = {"plain": [], "edited": []}, threading.Barrier(2)

    def run(kind):
        barrier.wait()
        for _ in range(20):
            with torch.no_grad():
                edits = {"layers.1.layer_output": Zero()} if kind == "edited" else None
                results[kind].append(plain(small_ids, edits=edits).logits)

    threads = [threading.Thread(target=run, args=(kind,)) for kind in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results["plain"]) == len(results["edited"]) == 20
    assert all(torch.equal(logits, expected_plain) for logits in results["plain"])
    assert all(torch.equal(logits, expected_edited) for logits in results["edited"])


def test_calls_nest_inside_an_edit(plain, small_ids):
    """An edit function may call the instrumented model itself: the inner call runs without the
    outer call's edits, and the outer edit still applies after it."""
    inner = {}

    def edit(x):
        inner["logits"] = plain(small_ids).logits
        return torch.zeros_like(x)

    with torch.no_grad():
        nested = plain(small_ids, edits={"layers.1.layer_output": edit})
        zeroed = plain(small_ids, edits={"layers.1.layer_output": Zero()})
        clean = plain(small_ids)
    assert torch.equal(inner["logits"], clean.logits)
    assert torch.equal(nested.logits, zeroed.logits)


def test_a_failing_edit_leaves_the_next_call_clean(plain, sdpa_model, small_ids):
    def broken(x):
        raise RuntimeError("my edit is broken")

    with pytest.raises(RuntimeError, match="my edit is broken"):
        plain(small_ids, edits={"layers.1.layer_output": broken})
    with torch.no_grad():
        assert torch.equal(plain(small_ids).logits, hf_logits(sdpa_model, small_ids))


def test_user_hooks_are_never_traced_into_the_program(fresh_model, small_ids, tmp_path, monkeypatch):
    monkeypatch.setenv("QGRAPH_PROGRAM_CACHE", "1")
    monkeypatch.setenv("QGRAPH_CACHE", str(tmp_path))
    layers = fresh_model.model.layers
    clean = hf_logits(fresh_model, small_ids)
    handles = [layers[0].register_forward_hook(lambda m, a, o: o + 1.0),
               layers[1].mlp.register_forward_pre_hook(lambda m, a: (a[0] * 2,))]
    with pytest.warns(UserWarning, match=r"hooks registered on layers.0.*do not run"):
        ig = qgraph.instrument(fresh_model, values=["layers.*.layer_output"])
    with torch.no_grad():
        assert torch.equal(ig(small_ids).logits, clean)  # the program never runs the hooks
    assert [len(layers[0]._forward_hooks), len(layers[1].mlp._forward_pre_hooks)] == [1, 1]  # still the user's
    assert not torch.equal(hf_logits(fresh_model, small_ids), clean)  # and they still run in the model
    for handle in handles:
        handle.remove()
    # the program saved to the disk cache has no hooks either: a clean load in a fresh model object reads it
    other = AutoModelForCausalLM.from_pretrained(fresh_model.name_or_path).eval()
    loaded = qgraph.instrument(other, values=["layers.*.layer_output"])
    assert loaded.exported.from_cache
    with torch.no_grad():
        assert torch.equal(loaded(small_ids).logits, hf_logits(other, small_ids))


def test_a_replaced_submodule_is_read_on_the_next_call(fresh_model, small_ids):
    ig = qgraph.instrument(fresh_model, values=["layers.3.mlp.down_proj.input", "layers.3.mlp.down_proj.output"])
    old = fresh_model.model.layers[3].mlp.down_proj
    torch.manual_seed(0)
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    fresh_model.model.layers[3].mlp.down_proj = new
    with torch.no_grad():
        out = ig(small_ids)
        assert torch.equal(out.logits, hf_logits(fresh_model, small_ids))
        assert torch.equal(out["layers.3.mlp.down_proj.output"], new(out["layers.3.mlp.down_proj.input"]))


def test_untied_lm_head_is_read_on_the_next_call(fresh_model, small_ids):
    ig = qgraph.instrument(fresh_model)
    head = fresh_model.lm_head
    assert head.weight is fresh_model.model.embed_tokens.weight
    head.weight = torch.nn.Parameter(head.weight.detach() + 0.5)  # untie
    with torch.no_grad():
        assert torch.equal(ig(small_ids).logits, hf_logits(fresh_model, small_ids))


def test_a_model_moved_to_another_dtype_is_re_exported(fresh_model, small_ids):
    ig = qgraph.instrument(fresh_model, values=["layers.*.layer_output"])
    fresh_model.to(torch.float64)
    with torch.no_grad():
        out = ig(small_ids)
    assert out.logits.dtype == torch.float64
    assert torch.equal(out.logits, hf_logits(fresh_model, small_ids))


def test_the_inner_model_is_refused_by_name(sdpa_model):
    with pytest.raises(qgraph.UnsupportedModel, match="inner model.*not model.model"):
        qgraph.instrument(sdpa_model.model)


def test_values_take_one_string_or_none(sdpa_model, small_ids):
    one = qgraph.instrument(sdpa_model, values="layers.*.layer_output")
    none = qgraph.instrument(sdpa_model, values=None)
    assert one.values == [f"layers.{i}.layer_output" for i in range(4)] and none.values == []
    with torch.no_grad():
        assert torch.equal(none(small_ids).logits, one(small_ids).logits)


def test_steer_per_call_equals_adding_by_hand(plain, small_ids):
    vector = torch.randn(64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        steered = plain(small_ids, edits=qgraph.steer(2, vector, 2.0))
        by_hand = plain(small_ids, edits={"layers.2.layer_output": Add(vector * 2.0)})
    assert torch.equal(steered.logits, by_hand.logits)


def another_value(value):
    """Another value of the same kind (what a user might set)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5 + 1
    if isinstance(value, str):
        return value + "-changed"
    if isinstance(value, (list, tuple)):
        return type(value)([*value, value[-1] if value else 0])
    return "changed" if value is None else None


def test_every_value_the_export_baked_in_is_part_of_the_fingerprint(fresh_model):
    """The set comes from the export: each member changed alone changes the model's fingerprint."""
    from qgraph.export import constants
    from qgraph.export.fingerprint import fingerprint
    ig = qgraph.instrument(fresh_model)
    reads = ig.exported.reads
    members = {(path, attribute) for path, attribute, _ in constants.current(fresh_model, reads)}
    # what the issue names is among them: a norm's eps, attention scaling, the rotary, config fields
    assert {("model.norm", "eps"), ("model.layers.3.self_attn", "scaling"),
            ("model.rotary_emb", "attention_scaling"), ("model.layers.0.linear_attn.norm", "variance_epsilon"),
            ("config", "output_hidden_states")} <= members
    objects = dict(constants.objects(fresh_model))
    before, changed = fingerprint(fresh_model, reads), 0
    for path, attribute in sorted(members):
        owner = objects[path]
        value = getattr(owner, attribute)
        try:
            setattr(owner, attribute, another_value(value))
        except (AttributeError, TypeError, ValueError):  # a property that refuses the value cannot go stale either
            continue
        try:
            assert fingerprint(fresh_model, reads) != before, f"{path}.{attribute}"
            changed += 1
        finally:
            setattr(owner, attribute, value)
    assert fingerprint(fresh_model, reads) == before
    assert changed >= len(members) - 3


def test_a_changed_eps_or_scaling_rebuilds_the_program(fresh_model, small_ids):
    ig = qgraph.instrument(fresh_model, values=["layers.3.layer_output"])
    fresh_model.model.norm.eps = 0.5
    with torch.no_grad():
        assert torch.equal(ig(small_ids).logits, hf_logits(fresh_model, small_ids))
    fresh_model.model.layers[3].self_attn.scaling *= 3
    fresh_model.model.rotary_emb.attention_scaling = 0.7
    with torch.no_grad():
        out = ig(small_ids)
        assert torch.equal(out.logits, hf_logits(fresh_model, small_ids))
        # a later call with nothing changed reuses the program
        program = ig.program
        ig(small_ids)
    assert ig.program is program


def test_each_program_runs_the_kernels_it_was_exported_with(checkpoint, small_ids, monkeypatch):
    """Two models exported under two delta-rule kernels in one process: each program keeps its own."""
    import importlib
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    original = module.torch_chunk_gated_delta_rule

    def other_kernel(*args, **kwargs):  # another kernel: the same rule, its output scaled
        output, state = original(*args, **kwargs)
        return output * 0.5, state

    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", other_kernel)
    # built under the other kernel: transformers before 5.15 binds it to each DeltaNet as it is built
    first = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        first_reference = hf_logits(first, small_ids)
    ig_first = qgraph.instrument(first)
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", original)
    second = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ig_second = qgraph.instrument(second)  # exported last, under transformers' own kernel
    with torch.no_grad():
        second_reference = hf_logits(second, small_ids)
        assert not torch.allclose(first_reference, second_reference)
        assert torch.equal(ig_first(small_ids).logits, first_reference)
        assert torch.equal(ig_second(small_ids).logits, second_reference)
