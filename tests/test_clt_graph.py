"""Attribution graphs through a cross-layer transcoder: the active features and their pre-activations are
the CLT's math on the plain HF forward, a feature's edge to every target is what adding its decoders to
every block it writes moves in the frozen model (decoders read from the files, not through the record),
every target is its row plus its constant, and the JSON validates against circuit-tracer's models."""
from __future__ import annotations

import json

import pytest
import torch

import qgraph
from qgraph.export import export_model
from qgraph.passes.replacement import EMBEDDINGS, frozen, inject_name
from qgraph.program import Program
from qgraph.testing import tiny_clt
from test_clt import BLOCKS, FileMath, hf_run

PROMPT = torch.tensor([5, 17, 99, 3, 42, 7])


@pytest.fixture(scope="module", params=[("mlp_input", True), ("layer_mid", False)], ids=["jumprelu", "layer_mid"])
def traced(request, sdpa_model, tmp_path_factory):
    reads, jumprelu = request.param
    folder = tiny_clt(tmp_path_factory.mktemp("clt"), sdpa_model, d_transcoder=16, jumprelu=jumprelu, reads=reads)
    return reads, folder, qgraph.attribution_graph(sdpa_model, PROMPT, folder, batch_size=16)


def _complete(graph) -> float:
    rows = [i for i, node in enumerate(graph.nodes) if node.kind in ("feature", "logit")]
    total = graph.adjacency[rows].sum(1) + graph.constants[rows]
    scale = graph.adjacency[rows].abs().sum(1) + graph.constants[rows].abs()
    return ((total - graph.node_inputs[rows]).abs() / scale).max().item()


def test_the_features_are_the_clts_math_on_the_hf_forward_and_every_target_closes(sdpa_model, traced):
    reads, folder, graph = traced
    math = FileMath(folder, "circuit-tracer")
    _, seen = hf_run(sdpa_model, PROMPT[None], reads)
    active = {(i, p, f) for i in range(BLOCKS) for p, f in (math.encode(i, seen[i]["x"][0]) != 0).nonzero().tolist()}
    features = [n for n in graph.nodes if n.kind == "feature"]
    assert {(n.layer, n.position, n.feature) for n in features} == active and len(active) > 20
    for i, node in enumerate(graph.nodes):
        if node.kind == "feature":
            x = seen[node.layer]["x"][0, node.position]
            pre = float(torch.nn.functional.linear(x, math.blocks[node.layer]["W_enc"],
                                                   math.blocks[node.layer]["b_enc"])[node.feature])
            assert float(graph.node_inputs[i]) == pytest.approx(pre, rel=1e-4, abs=1e-5)
            assert node.activation == pytest.approx(float(math.encode(node.layer, x)[node.feature]), rel=1e-4)
    assert _complete(graph) < 1e-4  # completeness: every target is its row plus its constant


def test_a_features_edges_are_what_its_decoders_into_every_later_block_move(sdpa_model, traced):
    reads, folder, graph = traced
    clt = qgraph.CrossLayerTranscoder.load(folder)
    math = FileMath(folder, "circuit-tracer")
    program = Program(sdpa_model, export_model(sdpa_model, images=False))
    program.build([f"layers.{i}.{reads}" for i in range(BLOCKS)], {}, True, replacement=clt)
    width, seq = sdpa_model.config.hidden_size, len(PROMPT)

    def run(**added):
        inputs = {"input_ids": PROMPT[None], "attention_mask": torch.ones(1, seq, dtype=torch.long)}
        for name in (EMBEDDINGS, *(inject_name(i) for i in range(BLOCKS))):
            inputs[name] = added.get(name, torch.zeros(1, seq, width))
        return program.run(inputs)

    def target_inputs(logits, captured):
        values = torch.zeros(len(graph.nodes))
        last = logits[0, -1].detach().double()
        for i, node in enumerate(graph.nodes):
            if node.kind == "feature":
                x = captured[f"layers.{node.layer}.{reads}"][0, node.position].detach()
                values[i] = float(x @ math.blocks[node.layer]["W_enc"][node.feature])
            elif node.kind == "logit":
                values[i] = float(last[node.feature] - last.mean())
        return values

    recorded = {}
    with frozen(recorded):
        before = target_inputs(*run())
    targets = [i for i, n in enumerate(graph.nodes) if n.kind in ("feature", "logit")]
    block0 = [i for i, n in enumerate(graph.nodes) if n.kind == "feature" and n.layer == 0]
    checked = 0
    for source in block0[:3]:
        node = graph.nodes[source]
        added = {}
        for j in range(node.layer, BLOCKS):  # the decoder into each block it writes, from the file
            vector = torch.zeros(1, seq, width)
            vector[0, node.position] = node.activation * math.blocks[node.layer]["W_dec"][node.feature, j - node.layer]
            added[inject_name(j)] = vector
        with frozen(recorded, replay=True):
            after = target_inputs(*run(**added))
        change, edge = (after - before)[targets], graph.adjacency[targets, source]
        torch.testing.assert_close(change, edge, rtol=1e-3, atol=1e-5)
        checked += int((edge.abs() > 1e-3).sum())
    assert checked > 5  # the features reach targets in later blocks and the logits


def test_the_clt_graph_writes_circuit_tracers_json(traced, tmp_path):
    models = pytest.importorskip("circuit_tracer.frontend.graph_models")
    graph = traced[2].prune()
    data = json.loads(graph.to_json(tmp_path / "clt.json", slug="clt").read_text())
    assert {n["feature_type"] for n in data["nodes"] if n["node_id"].split("_")[1] != "-1"} >= {"cross layer transcoder"}
    models.Model.model_validate(data)
    replacement, completeness = graph.scores()
    assert 0 <= replacement <= 1 and 0 < completeness <= 1


def test_the_estimate_reads_the_clt_and_a_clt_of_another_shape_is_refused(sdpa_model, traced, tmp_path):
    _, folder, graph = traced
    estimate = qgraph.circuits.estimate(sdpa_model, PROMPT, folder, batch_size=16)
    assert estimate.feature_nodes == estimate.active_features == graph.count("feature")
    clt = qgraph.CrossLayerTranscoder.load(folder)
    short = qgraph.CrossLayerTranscoder(list(clt.W_enc)[:3], list(clt.b_enc)[:3], [w[:, :3 - i] for i, w in
                                        enumerate(list(clt.W_dec)[:3])], list(clt.b_dec)[:3])
    with pytest.raises(qgraph.QgraphError, match="covers 3 blocks .* the model has 4 blocks"):
        qgraph.attribution_graph(sdpa_model, PROMPT, short)
