"""Compiled captures: values under torch.compile equal the eager program's; each kind of block compiles once, and
no length recompiles."""
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


@pytest.fixture(scope="module")
def regional(sdpa_model):
    """The tiny model (3 DeltaNet blocks, 1 attention) eager and under inductor (the default): every block's
    output, the DeltaNet's inner values (the delta-rule custom op, the conv) at every DeltaNet block, so the
    three are alike, and the logits; compiled once for the module."""
    values = ["layers.*.layer_output", "layers.*.linear_attn.attention_head_outputs",
              "layers.*.linear_attn.state_output", "layers.*.linear_attn.decays"]
    return (qgraph.instrument(sdpa_model, values=values),
            qgraph.instrument(sdpa_model, values=values, compile=True))


@pytest.mark.slow  # it compiles with inductor: the slow tier
def test_each_kind_of_block_compiles_once_and_serves_every_length(regional):
    eager, compiled = regional
    regions = compiled.program_for(False).runner.compiled.regions
    # what precedes the blocks, the 3 DeltaNet blocks (one group), the attention block, the final norm and head
    assert len(regions) == 6 and regions.group == [0, 1, 1, 1, 2, 3]
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        # past the kernel's 64-token chunk at the second length; then another batch and length
        for batch, seq in ((2, 7), (2, 70), (3, 33)):
            ids = random_ids(batch, seq, seed=seq)
            assert _max_difference(compiled(ids), eager(ids)) <= 1e-5
            assert counters["stats"]["unique_graphs"] - graphs == 4  # one graph per group, for every call


@pytest.mark.slow  # it compiles with inductor: the slow tier
def test_the_conv_backward_under_grad_compiles_one_graph_for_every_length():
    # the DeltaNet's causal conv: inductor's lowering of its backward fixed the length (qgraph.compat fixes it),
    # so every new length under grad mode compiled again
    from qgraph.compat import inductor_symbolic_strides_fix
    inductor_symbolic_strides_fix()
    conv = torch.nn.Conv1d(8, 8, 4, groups=8, padding=3, bias=False)
    compiled = torch.compile(lambda x: torch.nn.functional.silu(conv(x)[..., :x.shape[-1]]), fullgraph=True)
    graphs = counters["stats"]["unique_graphs"]
    for seq in (5, 12, 9):
        x = torch.randn(2, 8, seq, requires_grad=True)
        torch._dynamo.maybe_mark_dynamic(x, 2)
        compiled(x).square().sum().backward()
        want = torch.autograd.grad(torch.nn.functional.silu(conv(x)[..., :seq]).square().sum(), x)[0]
        torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-6)
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
@pytest.mark.slow  # it compiles with inductor: the slow tier
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
