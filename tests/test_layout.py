"""The pipeline's seams: the pass runner, the family schema, the one program builder, the docs' picture."""
from pathlib import Path

import pytest
import torch
from torch.fx.passes.infra.pass_base import PassResult

import qgraph
from qgraph.render.engine import draw
from qgraph.export import export_model
from qgraph.families import FAMILIES, family_for
from qgraph.kernels.ops import STATES_OP
from qgraph.passes.base import GraphPass, run_passes
from qgraph.values.locate import OnRequest
from qgraph.rewrites.on_request import DecomposeSdpa, OpenConvContext, ReadAsAttention, SwapForStates, SwapForWrites
from qgraph.program import Program
from qgraph.render.graph import GraphView

ROOT = Path(__file__).resolve().parent.parent


class _Relu(GraphPass):
    """Puts a relu after every add."""

    def call(self, graph_module):
        for node in list(graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)):
            with graph_module.graph.inserting_after(node):
                relu = graph_module.graph.call_function(torch.ops.aten.relu.default, (node,))
            node.replace_all_uses_with(relu, delete_user_cb=lambda user: user is not relu)
        return PassResult(graph_module, True)


class _Broken(GraphPass):
    """Leaves a node reading a node defined after it (the lint's business)."""

    def call(self, graph_module):
        graph = graph_module.graph
        add = next(iter(graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)))
        with graph.inserting_before(add):
            graph.call_function(torch.ops.aten.neg.default, (add,))
        return PassResult(graph_module, True)


def _add_module():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (x, x)))
    return torch.fx.GraphModule({}, graph)


def test_the_runner_runs_passes_in_order():
    module = run_passes(_add_module(), [_Relu()])
    module.recompile()
    assert torch.equal(module(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 4.0]))


def test_a_broken_graph_fails_the_lint_naming_the_passes_run():
    with pytest.raises(RuntimeError) as caught:  # the lint's error, its type and message kept
        run_passes(_add_module(), [_Relu(), _Broken()])
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "fails its lint after the passes _Relu, _Broken" in notes


class _Raises(GraphPass):
    def call(self, graph_module):
        raise KeyError("the pass's own error")


def test_a_failing_pass_is_named_with_the_ones_before_it():
    with pytest.raises(KeyError) as caught:
        run_passes(_add_module(), [_Relu(), _Raises(), _Relu()])
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "in pass _Raises, after _Relu" in notes


def test_a_users_error_in_a_pass_keeps_its_type(sdpa_model):
    with pytest.raises(ValueError, match="not both") as caught:
        qgraph.instrument(sdpa_model, values={"layers.0.linear_attn.states": {},
                                              "layers.0.linear_attn.state": {"positions": [0]}})
    assert any("MakeOnRequest" in note for note in getattr(caught.value, "__notes__", []))


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_fills_its_schema_consistently(family):
    mixer_modules = {mixer.module for mixer in family.mixers.values()}
    for spec in family.values:
        assert spec.host in family.hosts, f"{spec.name}: host {spec.host!r} has no template"
    for mixer in family.mixers.values():
        assert mixer.module in family.hosts, f"mixer {mixer.module} has no host template"
    # what a decoding step carries: each mixer's memory, and other hosts' (qwen4_exp's PLE layers)
    memory = [(mixer.module, mixer.memory) for mixer in family.mixers.values()] + list(family.memory.items())
    for host, pieces in memory:
        assert host in family.hosts, f"memory of {host}, which has no host template"
        names = {spec.name for spec in family.values if spec.host == host}
        for piece in pieces:
            assert set(piece.dims) - {"past"} <= set(family.dims), f"{host}.{piece.name}: unknown dims"
            assert not piece.carries or set(piece.carries) <= names, f"{piece.carries}: not values of {host}"
            assert piece.grows is None or piece.grows in names, f"{piece.grows}: not a value of {host}"
    assert family.vision_mixer is None or family.images is not None
    assert mixer_modules <= set(family.hosts)


def test_the_family_sizes_every_dim_of_the_tiny_model(sdpa_model):
    family = family_for(sdpa_model)
    config = sdpa_model.config
    text = config.get_text_config()
    for name in family.dims:
        if not name.startswith("vision"):
            assert isinstance(family.dim(config, name), int), name
    # what a decoding step carries, by the family, is what HF's own cache holds per block
    memory = dict(family.memory_hosts(config))
    assert len(memory) == text.num_hidden_layers
    assert sum(mixer.recurrent for mixer in memory.values()) == text.layer_types.count("linear_attention")


def test_on_request_values_are_typed_rewrites(sdpa_model):
    catalogue = Program(sdpa_model, export_model(sdpa_model, images=False)).catalogue
    kinds = {name.rsplit(".", 1)[-1]: type(entry.location.rewrite) for name, entry in catalogue.items()
             if isinstance(entry.location, OnRequest)}
    assert kinds == {"attention_scores": DecomposeSdpa, "attention_probabilities": DecomposeSdpa,
                     "states": SwapForStates, "state": SwapForStates, "conv_state_input": OpenConvContext,
                     "conv_state_output": OpenConvContext, "effective_attention": ReadAsAttention,
                     "initial_state_output": ReadAsAttention, "write_values": SwapForWrites}


def test_the_diagram_reads_the_program_the_builder_makes(sdpa_model):
    exported = export_model(sdpa_model, images=False)
    view = GraphView(sdpa_model, exported, requested=["layers.0.linear_attn.states"])
    made = Program(sdpa_model, exported).make(["layers.0.linear_attn.states"])
    ops = lambda graph: [str(node.target) for node in graph.nodes]  # noqa: E731
    assert ops(view.graph) == ops(made.graph)
    assert STATES_OP in [node.target for node in view.graph.nodes]
    assert view.catalogue["layers.0.linear_attn.states"].location.node.args[0].target is STATES_OP


def test_the_architecture_picture_is_valid_dot():
    source = (ROOT / "docs" / "pipeline.dot").read_text()
    svg = draw(source, "svg").decode()
    assert "program.py" in svg and "families/" in svg


def test_a_program_keeps_the_passes_it_ran_in_order(sdpa_model):
    program = Program(sdpa_model, export_model(sdpa_model, images=False)).build(
        ["layers.0.linear_attn.states"], {}, True)
    assert program.passes_run == ["MakeOnRequest(layers.0.linear_attn.states)", "InsertEditSlots", "Tap",
                                  "StripMarkers", "Prune"]
