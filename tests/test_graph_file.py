"""Reading circuit-tracer's graph files (qgraph/circuits/graphfile.py, ``AttributionGraph.from_json``).

A file written by circuit-tracer's own pruning and pydantic models (0.5.0's error ids, or the fixed ones)
reads back node for node and weight for weight, as the graph qgraph prunes itself; what ``to_json`` writes
reads back to the same file. A file is untrusted input: its bytes and counts are bounded before parsing,
every field is checked, and each refusal names the file, the entry and the problem.
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from qgraph import AttributionGraph
from qgraph.errors import InvalidArgument, MissingFile
from test_circuit_graph import chain_graph, circuit_tracer_file, fixed_error_ids, random_graph
from test_graph_viewer import graph_edges, nodes_and_edges


# -- reading circuit-tracer's files ----------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("fixed_ids", [True, False])
def test_from_json_reads_the_file_circuit_tracer_writes(tmp_path, monkeypatch, seed, fixed_ids):
    """circuit-tracer's own pruning and pydantic models write the file (0.5.0's error ids, or the fixed ones);
    the graph read back has its nodes, weights, activations, influences and logits."""
    if fixed_ids:
        fixed_error_ids(monkeypatch, pytest.importorskip("circuit_tracer.frontend.graph_models"))
    graph = random_graph(seed)
    model = circuit_tracer_file(graph, 0.8, 0.98)
    path = tmp_path / "theirs.json"
    path.write_text(model.model_dump_json(indent=2), encoding="utf-8")
    file = json.loads(path.read_text())
    if not fixed_ids and len({n["node_id"] for n in file["nodes"]}) < len(file["nodes"]):
        pytest.skip("0.5.0's ids collide in this graph (test_from_json_refuses_bad_files covers that)")

    loaded = AttributionGraph.from_json(path)
    index = {node["node_id"]: i for i, node in enumerate(file["nodes"])}  # circuit-tracer's order is qgraph's
    assert len(loaded.nodes) == len(file["nodes"]) and int(loaded.edge_mask.sum()) == len(file["links"]) > 0
    for link in file["links"]:
        assert loaded.adjacency[index[link["target"]], index[link["source"]]].item() == link["weight"]
    assert loaded.adjacency.count_nonzero() == sum(link["weight"] != 0 for link in file["links"])
    for node, entry in zip(loaded.nodes, file["nodes"]):
        assert (node.layer if node.kind != "logit" else node.layer + 1) == (None if entry["layer"] == "E"
                                                                            else int(entry["layer"]))
        assert node.position == entry["ctx_idx"] and node.activation == entry["activation"]
        assert node.influence == entry["influence"]
    # the same graph qgraph prunes itself: the same nodes and the same weights
    pruned = graph.prune(0.8, 0.98)
    assert [(n.kind, n.layer, n.position, n.feature, n.activation, n.influence) for n in loaded.nodes] == \
           [(n.kind, n.layer, n.position, n.feature, n.activation, n.influence) for n in pruned.nodes]
    assert torch.equal(loaded.adjacency, pruned.adjacency) and torch.equal(loaded.edge_mask, pruned.edge_mask)
    assert torch.equal(loaded.logit_probabilities, pruned.logit_probabilities)
    assert loaded.logit_tokens == pruned.logit_tokens and loaded.tokens == graph.tokens
    assert loaded.n_layers == graph.n_layers and loaded.scan == "random" and loaded.pruned == (0.8, None)
    assert torch.equal(loaded.input_ids, graph.input_ids)
    assert nodes_and_edges(loaded.plot())[1] and set(nodes_and_edges(loaded.plot())[1]) == graph_edges(pruned)


def test_from_json_round_trips_what_to_json_writes(tmp_path):
    graph = chain_graph()
    written = graph.to_json(tmp_path / "g.json", slug="cat-sat", node_threshold=0.995, labels={(1, 3): "sitting"})
    loaded = AttributionGraph.from_json(written)
    assert loaded.json_data("cat-sat") == json.loads(written.read_text())  # every field, every weight
    assert loaded.labels == {(1, 3): "sitting"} and loaded.prompt == "The cat"
    assert all(math.isnan(v) for v in loaded.node_inputs.tolist())  # a file does not hold them
    assert loaded.scores() == pytest.approx(graph.prune(0.995, 0.98).scores(), nan_ok=True)


def _good_file(tmp_path) -> dict:
    return json.loads(chain_graph().to_json(tmp_path / "good.json", node_threshold=0.995).read_text())


def _set(data: dict, where: tuple, value) -> dict:
    target = data
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    return data


def _error_named_as_a_feature(data: dict) -> dict:
    """An error node with a feature's id, as circuit-tracer 0.5.0 named error (0, 5) and layer-0 feature 0."""
    error = next(node for node in data["nodes"] if node["feature_type"] == "mlp reconstruction error")
    error["node_id"] = data["nodes"][0]["node_id"]
    return data


BAD = {  # a change to a good file, and what the error says
    "metadata not an object": (lambda d: _set(d, ("metadata",), []), "the file has 'metadata' as list, not dict"),
    "no prompt tokens": (lambda d: d["metadata"].pop("prompt_tokens") and d, "no 'prompt_tokens'"),
    "a token not a string": (lambda d: _set(d, ("metadata", "prompt_tokens", 0), 5), "not strings"),
    "a weight as text": (lambda d: _set(d, ("links", 0, "weight"), "1.5"), "link 0 has 'weight' as str"),
    "a weight as a boolean": (lambda d: _set(d, ("links", 0, "weight"), True), "has 'weight' as a boolean"),
    "a link to no node": (lambda d: _set(d, ("links", 0, "source"), "9_9_9"), "names node '9_9_9'"),
    "a link twice": (lambda d: d["links"].append(dict(d["links"][0])) or d, "repeats the link"),
    "an unknown node type": (lambda d: _set(d, ("nodes", 0, "feature_type"), "neuron"), "feature_type 'neuron'"),
    "a position past the prompt": (lambda d: _set(d, ("nodes", 0, "ctx_idx"), 7), "outside the 2 prompt tokens"),
    "a layer that is no number": (lambda d: _set(d, ("nodes", 0, "layer"), "x"), "not a block number"),
    "a feature id that disagrees": (lambda d: _set(d, ("nodes", 0, "node_id"), "1_5_0"), "not '{layer}_{feature}"),
    "two nodes of one id": (_error_named_as_a_feature, "names two nodes '0_5_0'"),
    "a logit probability over 1": (lambda d: _set(d, ("nodes", -1, "token_prob"), 2.0), "probability from 0 to 1"),
    "no embedding for a token": (lambda d: _set(d, ("nodes",), [n for n in d["nodes"] if n["node_id"] != "E_12_1"]),
                                 "no embedding node at positions [1]"),
    "nodes not a list": (lambda d: _set(d, ("nodes",), {}), "has 'nodes' as dict"),
    "a layer of 5000 digits": (lambda d: _set(d, ("nodes", 0, "layer"), "9" * 5000), "not a block number"),
    "a feature of 5000 digits": (lambda d: _set(d, ("nodes", 0, "node_id"), "0_" + "9" * 5000 + "_0"),
                                 "not '{layer}_{feature}"),
    "a logit's token past int64": (lambda d: _set(d, ("nodes", -1, "feature"), 2 ** 64), "of a token id"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_from_json_refuses_bad_files(tmp_path, name):
    change, message = BAD[name]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(change(_good_file(tmp_path))))
    with pytest.raises(InvalidArgument, match=re.escape(message)) as caught:
        AttributionGraph.from_json(path)
    assert "bad.json" in str(caught.value)


def test_from_json_bounds_the_file_before_parsing(tmp_path):
    good = tmp_path / "good.json"
    data = _good_file(tmp_path)
    with pytest.raises(InvalidArgument, match="is 3,7.. bytes, over the bound of 100: pass max_bytes="):
        AttributionGraph.from_json(good, max_bytes=100)
    with pytest.raises(InvalidArgument, match=f"has {len(data['nodes'])} nodes, over the bound of 3"):
        AttributionGraph.from_json(good, max_nodes=3)
    with pytest.raises(InvalidArgument, match="links, over the bound of 2"):
        AttributionGraph.from_json(good, max_links=2)
    for text, problem in (("{" * 100_000, "not a JSON graph file"), ('{"metadata": NaN}', "not a number JSON has"),
                          ("\xff\xfe", "not a JSON graph file"), ("[1, 2]", "the file is list")):
        (tmp_path / "x.json").write_bytes(text.encode("latin-1"))
        with pytest.raises(InvalidArgument, match=problem):
            AttributionGraph.from_json(tmp_path / "x.json")
    with pytest.raises(MissingFile):
        AttributionGraph.from_json(tmp_path / "none.json")
