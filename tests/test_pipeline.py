"""The declared pipeline: one list of passes, run once in its order, handing results through the build."""
import pytest
import torch

import qgraph
from qgraph.export import export_model
from qgraph.kernels.ops import MARK_OP
from qgraph.passes.base import Build, BuildPass, Request, run_passes
from qgraph.passes.decode import OpenCache
from qgraph.passes.device import OnDevice
from qgraph.passes.edit import EditSlot, InsertEditSlots
from qgraph.passes.make import MakeOnRequest
from qgraph.passes.markers import StripMarkers
from qgraph.passes.pipeline import PIPELINE, build_passes
from qgraph.passes.replacement import Replacement
from qgraph.passes.tap import Prune, Tap
from qgraph.program import Program, _input_sources

from conftest import hf_logits, random_ids


def test_the_pipeline_reads_top_to_bottom():
    assert PIPELINE == (MakeOnRequest, OpenCache, Replacement, InsertEditSlots, Tap, StripMarkers, Prune, OnDevice)
    # every pass before StripMarkers reads the port markers; every pass after it runs without them
    stripped = PIPELINE.index(StripMarkers)
    assert all(graph_pass.markers is True for graph_pass in PIPELINE[:stripped + 1])
    assert all(graph_pass.markers is False for graph_pass in PIPELINE[stripped + 1:])


def _program(model):
    return Program(model, export_model(model, images=False))


def test_a_build_runs_the_passes_it_wants_once_and_hands_their_results_on(sdpa_model):
    program = _program(sdpa_model)
    slot = EditSlot(qgraph.edits.Target("layers.1.layer_output", "", ()), ())
    request = Request(["layers.1.layer_output", "layers.3.self_attn.attention_probabilities"],
                      {"layers.1.layer_output": slot}, logits=True)
    build = Build(program, request)
    passes = build_passes(build)
    assert [type(p) for p in passes] == [MakeOnRequest, InsertEditSlots, Tap, StripMarkers, Prune]
    run_passes(program.module, passes, program.passes_run)
    # the passes keep nothing on themselves: what they found is on the build
    assert build.tapped == ["layers.1.layer_output", "layers.3.self_attn.attention_probabilities"]
    assert build.slot_nodes["layers.1.layer_output"].target == "edit__layers_1_layer_output"
    assert not program.graph.find_nodes(op="call_function", target=MARK_OP)
    # the slot's node is what is tapped: an output reads it
    output = program.graph.output_node().args[0]
    assert build.slot_nodes["layers.1.layer_output"] in [arg for arg in output if isinstance(arg, torch.fx.Node)]


def test_generation_builds_run_open_cache_after_the_rewrites(sdpa_model):
    ig = qgraph.instrument(sdpa_model, values=["layers.3.self_attn.attention_probabilities"])
    ig.generate(random_ids(1, 5), max_new_tokens=1)
    decoder = next(iter(ig._decoders.values()))
    for program, recurrent in ((decoder.prompt, False), (decoder.decode, True)):
        ran = [name.split("(")[0] for name in program.passes_run]
        assert ran == ["MakeOnRequest", "OpenCache", "InsertEditSlots", "Tap", "StripMarkers", "Prune"]
        assert f"OpenCache(recurrent={recurrent})" in program.passes_run


def test_a_pass_on_the_wrong_side_of_strip_markers_is_an_internal_error_naming_it(sdpa_model):
    program = _program(sdpa_model)
    build = Build(program, Request(["layers.1.layer_output"]))
    with pytest.raises(qgraph.InternalError, match="Tap runs before the port markers are stripped") as caught:
        run_passes(program.module, [StripMarkers(build), Tap(build)], program.passes_run)
    assert "in pass Tap, after StripMarkers" in "\n".join(caught.value.__notes__)
    program = _program(sdpa_model)
    build = Build(program, Request(["layers.1.layer_output"]))
    with pytest.raises(qgraph.InternalError, match="Prune runs after the port markers are stripped"):
        run_passes(program.module, [Prune(build)])


def test_a_build_pass_refuses_another_graph_module(sdpa_model):
    program, other = _program(sdpa_model), _program(sdpa_model)
    with pytest.raises(qgraph.InternalError, match="another graph module"):
        run_passes(other.module, [Tap(Build(program, Request(["layers.1.layer_output"])))])


class _Negate(BuildPass):
    """A pass added to a pipeline: negates the logits (the model's first output)."""

    markers = False

    def call(self, graph_module):
        graph = graph_module.graph
        output = graph.output_node()
        logits = output.args[0][0]
        with graph.inserting_before(output):
            negated = graph.call_function(torch.ops.aten.neg.default, (logits,))
        output.args = ((negated, *output.args[0][1:]),)
        return torch.fx.passes.infra.pass_base.PassResult(graph_module, True)


def test_a_new_pass_is_one_entry_in_the_list(sdpa_model):
    program = _program(sdpa_model)
    build = Build(program, Request([]))
    run_passes(program.module, build_passes(build, (*PIPELINE, _Negate)), program.passes_run)
    program.module.recompile()
    ids = random_ids(1, 6)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    logits = program.module(*[source(inputs) for source in _input_sources(program.model, program.exported, {})])[0]
    torch.testing.assert_close(logits, -hf_logits(sdpa_model, ids))
    assert program.passes_run[-1] == "_Negate"
