"""Compiled captures: values under torch.compile equal the eager program's; no recompile per length."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import qgraph
from conftest import random_ids


def _max_difference(compiled, eager) -> float:
    assert compiled.values.keys() == eager.values.keys()
    worst = 0.0
    for name, value in eager.values.items():
        assert compiled.values[name].shape == value.shape, name
        worst = max(worst, (compiled.values[name].double() - value.double()).abs().max().item())
    if eager.logits is not None:
        worst = max(worst, (compiled.logits.double() - eager.logits.double()).abs().max().item())
    return worst


def test_compiled_values_equal_eager_for_two_lengths_without_recompiling(sdpa_model):
    # inductor (the default); one DeltaNet block keeps the C++ kernels few, and it runs the
    # delta-rule custom op and the conv, past the kernel's 64-token chunk at the second length
    values = ["layers.0.layer_output", "layers.0.linear_attn.attention_head_outputs",
              "layers.0.linear_attn.state_output", "layers.0.linear_attn.decays"]
    eager = qgraph.instrument(sdpa_model, values=values, logits=False)
    compiled = qgraph.instrument(sdpa_model, values=values, logits=False, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for seq in (7, 70):
            ids = random_ids(2, seq, seed=seq)
            assert _max_difference(compiled(ids), eager(ids)) <= 1e-5
        assert counters["stats"]["unique_graphs"] - graphs == 1  # one graph served both lengths
        ids = random_ids(3, 33, seed=3)  # a third length and another batch: still no recompile
        assert _max_difference(compiled(ids), eager(ids)) <= 1e-5
    assert counters["stats"]["unique_graphs"] - graphs == 1


@pytest.fixture(scope="module")
def slotted(sdpa_model):
    """Blocks 0-1 with declared edit slots, and with an edit fixed into the program, each eager and
    compiled (dynamo's graph capture with fullgraph=True, run without a backend compiler to keep
    the test fast: the capture is where a slot's Python branch could break the graph)."""
    values = ["layers.1.layer_output", "layers.0.linear_attn.attention_head_outputs", "layers.0.mlp.output"]
    slots = ["layers.0.layer_output", "layers.1.linear_attn.attention_head_outputs"]
    fixed = {"layers.0.mlp.output": qgraph.Scale(0.5)}
    return (qgraph.instrument(sdpa_model, values=values, edits=slots, logits=False),
            qgraph.instrument(sdpa_model, values=values, edits=slots, logits=False).compile(backend="eager"),
            qgraph.instrument(sdpa_model, values=values, edits=fixed, logits=False),
            qgraph.instrument(sdpa_model, values=values, edits=fixed, logits=False, compile={"backend": "eager"}))


@pytest.mark.compat
def test_compiled_program_with_edit_slots(slotted):
    eager, compiled, fixed_eager, fixed_compiled = slotted
    edits = {"layers.0.layer_output": lambda x: x * 2, "layers.1.linear_attn.attention_head_outputs": qgraph.Zero(heads=[1])}
    last = "layers.1.layer_output"
    with torch.no_grad():
        for seq in (9, 40):
            ids = random_ids(2, seq, seed=seq)
            plain = eager(ids)
            # slots with no edit: traced as the identity
            assert _max_difference(compiled(ids), plain) <= 1e-5
            # per-call edits: the call runs the eager program, and the edit lasts that call only
            edited = compiled(ids, edits=edits)
            assert _max_difference(edited, eager(ids, edits=edits)) <= 1e-5
            assert not torch.allclose(edited[last], plain[last])
            assert _max_difference(compiled(ids), plain) <= 1e-5
            # an edit fixed at instrument time is compiled in
            fixed = fixed_compiled(ids)
            assert _max_difference(fixed, fixed_eager(ids)) <= 1e-5
            assert not torch.allclose(fixed[last], plain[last])
