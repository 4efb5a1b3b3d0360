"""The attribution-graph result (qgraph/circuits/graph.py, graphfile.py) on small hand-made graphs: pruning
against an independent numpy computation of influence and against circuit-tracer's own ``prune_graph``;
the JSON file against circuit-tracer 0.5.0's pydantic models and its own ``create_graph_files`` steps.
The views and reading a file back: test_graph_viewer.py."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from qgraph.circuits.graph import FEATURE_TYPES, AttributionGraph, Node
from qgraph.errors import InvalidArgument, OutOfRange

# -- a hand-made graph ----------------------------------------------------------------------------------
# 2 blocks, 2 positions. Features a (L0 p0), b (L0 p1), c (L1 p1); errors (0,0) (0,1) (1,0) (1,1);
# embeddings of tokens 11, 12; logits 20 (p 0.7) and 21 (p 0.2) at the last position.
# b reads the second token but feeds nothing: it has no influence on the logits and must go.
A, B, C, E00, E01, E10, E11, T0, T1, L20, L21 = range(11)
EDGES = {(T0, A): 2.0, (T1, B): 1.0, (A, C): 1.5, (T1, C): 0.5, (E01, C): -0.25, (C, L20): 3.0, (C, L21): -1.0,
         (A, L20): 0.5, (T1, L20): 0.2, (E11, L20): 0.1, (T0, L21): 0.3}  # (source, target): direct effect


def chain_graph() -> AttributionGraph:
    nodes = [Node("feature", 0, 0, 5, activation=2.0), Node("feature", 0, 1, 7, activation=1.0),
             Node("feature", 1, 1, 3, activation=1.5)]
    nodes += [Node("error", layer, position, None) for layer in range(2) for position in range(2)]
    nodes += [Node("embedding", None, position, token) for position, token in enumerate([11, 12])]
    nodes += [Node("logit", 2, 1, 20, probability=0.7), Node("logit", 2, 1, 21, probability=0.2)]
    adjacency = torch.zeros(11, 11)
    for (source, target), weight in EDGES.items():
        adjacency[target, source] = weight
    return AttributionGraph(nodes, adjacency, torch.arange(11.0), torch.full((11,), 0.5), torch.tensor([11, 12]),
                            torch.tensor([0.7, 0.2]), tokens=["The", " cat"], logit_tokens=[" sat", " ran"],
                            scan="qwen3.5-tiny-transcoders")


def numpy_influence(adjacency: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``weights @ ((I - A)^-1 - I)`` with ``A`` the row-normalised ``|adjacency|``."""
    normalized = np.abs(adjacency)
    normalized = normalized / np.maximum(normalized.sum(1, keepdims=True), 1e-10)
    eye = np.eye(len(adjacency))
    return weights @ (np.linalg.inv(eye - normalized) - eye), normalized


def share_kept(scores: np.ndarray, share: float) -> set:
    """The highest scores, taken one by one until they hold ``share`` of the total (and any tied)."""
    total, held = scores.sum(), 0.0
    for i in np.argsort(-scores, kind="stable"):
        held += scores[i]
        if held >= share * total:
            return {int(j) for j in np.flatnonzero(scores >= scores[i])}
    return set(range(len(scores)))


def reference_prune(graph: AttributionGraph, node_threshold: float, edge_threshold: float):
    """Kept nodes and edges, computed independently in numpy and plain Python."""
    adjacency = graph.adjacency.double().numpy()
    kinds = [node.kind for node in graph.nodes]
    weights = np.zeros(len(kinds))
    weights[[i for i, k in enumerate(kinds) if k == "logit"]] = graph.logit_probabilities.double().numpy()
    influence, _ = numpy_influence(adjacency, weights)
    kept = share_kept(influence, node_threshold) | {i for i, k in enumerate(kinds) if k in ("embedding", "logit")}
    restricted = adjacency * np.array([[t in kept and s in kept for s in range(len(kinds))] for t in range(len(kinds))])
    restricted_influence, normalized = numpy_influence(restricted, weights)
    scores = normalized * (restricted_influence + weights)[:, None]
    flat = scores.flatten()
    edges = {divmod(int(k), len(kinds)) for k in share_kept(flat, edge_threshold) if flat[k] > 0}  # (t, s)
    while True:
        gone = {i for i in kept if kinds[i] in ("feature", "error") and not any(s == i for _, s in edges)}
        gone |= {i for i in kept if kinds[i] == "feature" and not any(t == i for t, _ in edges)}
        if not gone:
            return kept, edges, influence
        kept -= gone
        edges = {(t, s) for t, s in edges if t in kept and s in kept}


def test_prune_drops_the_feature_with_no_influence_and_keeps_what_numpy_says():
    graph = chain_graph()
    for node_threshold in (0.5, 0.8, 0.95, 0.99, 0.995):
        pruned = graph.prune(node_threshold, 0.9999)
        kept, edges, influence = reference_prune(graph, node_threshold, 0.9999)
        assert pruned.kept.tolist() == sorted(kept), node_threshold
        assert B not in kept and {C, T0, T1, L20, L21} <= kept and (A in kept) == (node_threshold > 0.6)
        assert np.allclose(pruned.node_influence.numpy(), influence[sorted(kept)], rtol=1e-5, atol=1e-7)
    # by hand: c and the first embedding hold 0.606 of the influence, with a 0.866; error (0,1) brings it to 0.9915
    assert graph.prune(0.5, 0.9999).kept.tolist() == [C, T0, T1, L20, L21]
    assert [n.node_id for n in graph.prune(0.8, 0.9999).nodes] == ["0_5_0", "1_3_1", "E_11_0", "E_12_1", "3_20_1",
                                                                    "3_21_1"]
    assert graph.prune(0.99, 0.9999).kept.tolist() == [A, C, E01, T0, T1, L20, L21]
    assert graph.prune(0.995, 0.9999).kept.tolist() == [A, C, E01, E11, T0, T1, L20, L21]


def test_prune_records_influence_as_circuit_tracers_cumulative_score():
    graph = chain_graph()
    pruned = graph.prune(0.995, 0.9999)
    weights = np.array([0] * 9 + [0.7, 0.2])
    influence, _ = numpy_influence(graph.adjacency.double().numpy(), weights)
    order = np.argsort(-influence, kind="stable")
    cumulative = np.empty(11)
    cumulative[order] = np.cumsum(influence[order]) / influence.sum()
    for node, i in zip(pruned.nodes, pruned.kept.tolist()):
        if node.kind == "logit":
            assert node.influence is None
        else:
            assert node.influence == pytest.approx(cumulative[i], abs=1e-6)
    assert min(pruned.nodes, key=lambda n: n.influence or 2).node_id == "1_3_1"  # c carries the most


def test_prune_drops_edges_by_threshold_and_nodes_left_without_edges():
    graph = chain_graph()
    for edge_threshold in (0.98, 0.95, 0.8, 0.6):
        pruned = graph.prune(0.995, edge_threshold)
        kept, edges, _ = reference_prune(graph, 0.995, edge_threshold)
        assert pruned.kept.tolist() == sorted(kept), edge_threshold
        index = pruned.kept.tolist()
        found = {(index[t], index[s]) for t, s in pruned.edge_mask.nonzero().tolist()}
        assert found == edges, edge_threshold
        for t, s in np.ndindex(*pruned.adjacency.shape):  # kept edges keep their weight, the others are 0
            expected = graph.adjacency[index[t], index[s]] if (index[t], index[s]) in edges else 0.0
            assert pruned.adjacency[t, s] == expected
    # by hand: at 0.98 the weakest edge, error (1,1) -> logit 20, goes and takes its only source with it
    at_98 = graph.prune(0.995, 0.98)
    assert E11 not in at_98.kept.tolist() and E01 in at_98.kept.tolist()
    # at 0.95 three more go: token 0 -> logit 21, token 1 -> logit 20 (the embeddings stay)
    at_95 = graph.prune(0.995, 0.95)
    assert at_95.adjacency[at_95.node_index("logit", None, 1, 21), at_95.node_index("embedding", None, 0, 11)] == 0
    assert at_95.count("embedding") == 2 and at_95.count("logit") == 2


def test_prune_checks_its_thresholds_and_refuses_a_cycle():
    graph = chain_graph()
    with pytest.raises(InvalidArgument, match="node_threshold"):
        graph.prune(1.5)
    with pytest.raises(InvalidArgument, match="edge_threshold"):
        graph.prune(0.8, -0.1)
    cyclic = chain_graph()
    cyclic.adjacency[A, C] = 1.0  # c -> a as well as a -> c
    with pytest.raises(InvalidArgument, match="cycle"):
        cyclic.prune()


def test_graph_checks_what_it_is_given():
    graph = chain_graph()
    with pytest.raises(InvalidArgument, match="order"):
        AttributionGraph(graph.nodes[::-1], graph.adjacency, graph.node_inputs, graph.constants, graph.input_ids,
                         graph.logit_probabilities)
    with pytest.raises(InvalidArgument, match=r"\[n, n\]"):
        AttributionGraph(graph.nodes, graph.adjacency[:5], graph.node_inputs, graph.constants, graph.input_ids,
                         graph.logit_probabilities)
    with pytest.raises(InvalidArgument, match="layer"):
        Node("error", 1, 0, 4)
    with pytest.raises(InvalidArgument, match="kind"):
        Node("neuron", 1, 0, 4)
    with pytest.raises(OutOfRange):
        graph.node_index("feature", 3, 0, 5)
    assert graph.node_index("error", 1, 1) == E11 and graph.node_index("logit", None, 1, 21) == L21
    assert repr(graph) == "AttributionGraph(3 features, 4 errors, 2 tokens, 2 logits, 11 edges)"
    assert graph.n_layers == 2


# -- the JSON file --------------------------------------------------------------------------------------
def write_chain(tmp_path) -> dict:
    written = chain_graph().to_json(tmp_path / "g.json", slug="cat-sat", node_threshold=0.995, edge_threshold=0.98,
                                    labels={(1, 3): "sitting"})
    return json.loads(written.read_text(encoding="utf-8"))


def test_json_validates_with_circuit_tracers_models(tmp_path):
    """circuit-tracer 0.5.0's pydantic models (pip install --no-deps circuit-tracer==0.5.0; pydantic)."""
    models = pytest.importorskip("circuit_tracer.frontend.graph_models")
    data = write_chain(tmp_path)
    model = models.Model.model_validate(data)
    assert model.metadata.scan == "qwen3.5-tiny-transcoders" and model.metadata.prompt_tokens == ["The", " cat"]
    assert model.metadata.node_threshold == 0.995 and model.metadata.prompt == "The cat"
    assert model.model_dump() == data  # every field written, none left to a default
    assert [n.node_id for n in model.nodes] == [n["node_id"] for n in data["nodes"]]


def test_json_follows_circuit_tracers_scheme(tmp_path):
    graph, data = chain_graph(), write_chain(tmp_path)
    assert set(data) == {"metadata", "qParams", "nodes", "links"}
    assert data["metadata"] == dict(slug="cat-sat", scan="qwen3.5-tiny-transcoders", transcoder_list=[],
                                    prompt_tokens=["The", " cat"], prompt="The cat", node_threshold=0.995,
                                    schema_version=1)
    assert data["qParams"] == dict(pinnedIds=[], supernodes=[], linkType="both", clickedId="", sg_pos="")

    pruned = graph.prune(0.995, 0.98)
    by_id = {node["node_id"]: node for node in data["nodes"]}
    expected_ids = {A: "0_5_0", C: "1_3_1", E01: "0_-1_1", T0: "E_11_0", T1: "E_12_1", L20: "3_20_1", L21: "3_21_1"}
    assert [node["node_id"] for node in data["nodes"]] == [expected_ids[i] for i in pruned.kept.tolist()]
    assert {node["feature_type"] for node in data["nodes"]} == set(FEATURE_TYPES.values())
    assert by_id["1_3_1"] | {"influence": 0} == dict(
        node_id="1_3_1", feature=(1 + 3) * (1 + 3 + 1) // 2 + 3, layer="1", ctx_idx=1,
        feature_type="cross layer transcoder", token_prob=0.0, is_target_logit=False, run_idx=0, reverse_ctx_idx=0,
        jsNodeId="1_3-0", clerp="sitting", influence=0, activation=1.5)
    assert (by_id["0_-1_1"]["feature"], by_id["0_-1_1"]["layer"], by_id["0_-1_1"]["jsNodeId"]) == (-1, "0", "0_1-0")
    assert (by_id["E_12_1"]["feature"], by_id["E_12_1"]["layer"], by_id["E_12_1"]["jsNodeId"]) == (1, "E", "E_12-1")
    top = by_id["3_20_1"]
    assert (top["feature"], top["layer"], top["ctx_idx"], top["is_target_logit"], top["jsNodeId"]) == \
           (20, "3", 1, True, "L_20-1")
    assert top["token_prob"] == pytest.approx(0.7) and top["clerp"] == 'Output " sat" (p=0.700)'
    assert by_id["3_21_1"]["is_target_logit"] is False and top["influence"] is None

    index = {node_id: i for i, node_id in enumerate(by_id)}
    assert len(data["links"]) == int(pruned.edge_mask.sum()) > 0
    for link in data["links"]:
        weight = pruned.adjacency[index[link["target"]], index[link["source"]]].item()
        assert link["weight"] == weight != 0
    assert {"source": "0_5_0", "target": "1_3_1", "weight": 1.5} in data["links"]


def test_json_folder_gets_the_graph_and_its_listing(tmp_path):
    graph = chain_graph().prune()
    graph.to_json(tmp_path, slug="one")
    graph.to_json(tmp_path, slug="two", scan=["layer0.safetensors", "layer1.safetensors"])
    graph.to_json(tmp_path, slug="one")
    listing = json.loads((tmp_path / "graph-metadata.json").read_text())["graphs"]
    assert [g["slug"] for g in listing] == ["two", "one"]
    assert listing[1] == json.loads((tmp_path / "one.json").read_text())["metadata"]
    two = json.loads((tmp_path / "two.json").read_text())["metadata"]
    assert two["scan"].startswith("custom-") and two["transcoder_list"] == ["layer0.safetensors", "layer1.safetensors"]
    assert two["scan"] == graph.json_data(scan=["layer0.safetensors", "layer1.safetensors"])["metadata"]["scan"]
    with pytest.raises(InvalidArgument, match="pruned already"):
        graph.to_json(tmp_path / "x.json", node_threshold=0.5)
    with pytest.raises(InvalidArgument, match=".json"):
        graph.to_json(tmp_path / "x.txt")


def random_graph(seed: int, n_layers: int = 3, seq: int = 4, n_logits: int = 3) -> AttributionGraph:
    """A random graph with circuit-tracer's structure: effects only go up the layers and along positions."""
    rng = np.random.default_rng(seed)
    features = sorted({(int(rng.integers(n_layers)), int(rng.integers(seq)), int(rng.integers(50)))
                       for _ in range(14)})
    nodes = [Node("feature", l, p, f, activation=float(np.float32(rng.uniform(0.1, 3)))) for l, p, f in features]
    nodes += [Node("error", l, p, None) for l in range(n_layers) for p in range(seq)]
    nodes += [Node("embedding", None, p, int(t)) for p, t in enumerate(rng.integers(100, 200, seq))]
    nodes += [Node("logit", n_layers, seq - 1, int(t)) for t in rng.choice(range(300, 400), n_logits, replace=False)]
    adjacency = torch.zeros(len(nodes), len(nodes))
    for t, target in enumerate(nodes):
        for s, source in enumerate(nodes):
            below = source.kind == "embedding" or (source.kind in ("feature", "error") and
                                                     (target.kind == "logit" or source.layer < (target.layer or 0)))
            if target.kind in ("feature", "logit") and below and source.position <= target.position \
                    and rng.random() < 0.45:
                adjacency[t, s] = float(rng.normal())
    probabilities = torch.tensor(sorted(rng.dirichlet(np.ones(n_logits + 1))[:n_logits], reverse=True),
                                 dtype=torch.float32)
    return AttributionGraph(nodes, adjacency, torch.zeros(len(nodes)), torch.zeros(len(nodes)),
                            torch.tensor([n.feature for n in nodes if n.kind == "embedding"]), probabilities,
                            tokens=[f"t{p}" for p in range(seq)], logit_tokens=[f"o{j}" for j in range(n_logits)],
                            scan="random")


def fixed_error_ids(monkeypatch, models):
    """circuit-tracer 0.5.0's ``Node.error_node`` with its later fix of the error node's id (issue 78:
    ``{layer}_-1_{pos}``, not ``0_{layer}_{pos}``, the id of layer-0 feature ``layer`` too); the rest its own."""
    made = models.Node.error_node.__func__

    def error_node(cls, layer, pos, influence=None):
        return made(cls, layer, pos, influence=influence).model_copy(update={"node_id": f"{layer}_-1_{pos}"})
    monkeypatch.setattr(models.Node, "error_node", classmethod(error_node))


def circuit_tracer_file(graph: AttributionGraph, node_threshold: float, edge_threshold: float):
    """The graph file circuit-tracer itself writes for ``graph``: its own prune_graph, create_nodes,
    create_used_nodes_and_edges and build_model (its pydantic ``Model``), on what they read of its Graph."""
    graph_module = pytest.importorskip("circuit_tracer.graph")
    files = pytest.importorskip("circuit_tracer.utils.create_graph_files")
    features = [n for n in graph.nodes if n.kind == "feature"]
    vocabulary = {n.feature: graph.tokens[n.position] for n in graph.nodes if n.kind == "embedding"}
    reference = SimpleNamespace(  # what those functions read of circuit-tracer's Graph
        input_string="".join(graph.tokens), input_tokens=graph.input_ids, n_pos=len(graph.input_ids),
        cfg=SimpleNamespace(n_layers=graph.n_layers), adjacency_matrix=graph.adjacency,
        active_features=torch.tensor([[n.layer, n.position, n.feature] for n in features]),
        selected_features=torch.arange(len(features)), activation_values=torch.tensor([n.activation for n in features]),
        logit_targets=[(graph.logit_tokens[j], n.feature) for j, n in enumerate(n for n in graph.nodes
                                                                                 if n.kind == "logit")],
        logit_probabilities=graph.logit_probabilities)
    tokenizer = SimpleNamespace(decode=lambda t: vocabulary[int(t)])
    node_mask, edge_mask, scores = graph_module.prune_graph(reference, node_threshold, edge_threshold)
    nodes = files.create_nodes(reference, node_mask, tokenizer, scores)
    used_nodes, used_edges = files.create_used_nodes_and_edges(reference, nodes, edge_mask)
    return files.build_model(reference, used_nodes, used_edges, "s", "random", node_threshold, tokenizer)


@pytest.mark.parametrize("seed", range(4))
def test_prune_and_json_match_circuit_tracer_itself(seed, monkeypatch):
    """circuit-tracer's own prune_graph, create_nodes, create_used_nodes_and_edges and build_model, run on
    the same graph, write the same file (with its fixed error node ids)."""
    fixed_error_ids(monkeypatch, pytest.importorskip("circuit_tracer.frontend.graph_models"))
    graph = random_graph(seed)
    for node_threshold, edge_threshold in ((0.8, 0.98), (0.5, 0.9), (0.95, 0.7), (0.99, 0.99)):
        theirs = json.loads(circuit_tracer_file(graph, node_threshold, edge_threshold).model_dump_json())
        ours = json.loads(json.dumps(graph.json_data("s", node_threshold=node_threshold,
                                                     edge_threshold=edge_threshold)))
        assert ours["nodes"] == theirs["nodes"], (node_threshold, edge_threshold)
        assert ours["links"] == theirs["links"] and ours["metadata"] == theirs["metadata"]
        assert len(ours["links"]) > 0


def colliding_graph() -> AttributionGraph:
    """2 blocks, 2 positions, where circuit-tracer 0.5.0's ids collide: layer-0 feature 0 at position 0 and
    error (0, 0) were both ``0_0_0``, layer-0 feature 1 at position 1 and error (1, 1) both ``0_1_1``."""
    nodes = [Node("feature", 0, 0, 0, activation=1.0), Node("feature", 0, 1, 1, activation=2.0),
             Node("feature", 1, 1, 3, activation=0.5)]
    nodes += [Node("error", layer, position, None) for layer in range(2) for position in range(2)]
    nodes += [Node("embedding", None, p, t) for p, t in enumerate([11, 12])]
    nodes += [Node("logit", 2, 1, 20, probability=0.6), Node("logit", 2, 1, 21, probability=0.3)]
    x, y, z, e00, e01, e10, e11, t0, t1, l20, l21 = range(11)
    edges = {(t0, x): 2.0, (t1, y): 1.0, (x, z): 1.0, (y, z): 1.5, (e00, z): 0.4, (e01, z): -0.3, (z, l20): 3.0,
             (z, l21): -1.0, (y, l20): 0.8, (e11, l20): 0.5, (e10, l21): 0.3, (x, l21): 0.6, (t1, l20): 0.2}
    adjacency = torch.zeros(11, 11)
    for (source, target), weight in edges.items():
        adjacency[target, source] = weight
    return AttributionGraph(nodes, adjacency, torch.zeros(11), torch.zeros(11), torch.tensor([11, 12]),
                            torch.tensor([0.6, 0.3]), tokens=["a", "b"], logit_tokens=["c", "d"], scan="s")


def test_json_ids_are_unique_where_circuit_tracer_050s_collide(tmp_path):
    models = pytest.importorskip("circuit_tracer.frontend.graph_models")
    decode = pytest.importorskip("circuit_tracer.utils.decode_url_features").decode_url_features
    graph = colliding_graph().prune(1.0, 1.0)
    assert len(graph.nodes) == 11  # every node kept, every edge too
    # the collisions, as circuit-tracer 0.5.0 itself names these nodes
    assert models.Node.feature_node(0, 0, 0).node_id == models.Node.error_node(0, 0).node_id == "0_0_0"
    assert models.Node.feature_node(0, 1, 1).node_id == models.Node.error_node(1, 1).node_id == "0_1_1"

    data = json.loads(graph.to_json(tmp_path / "g.json").read_text(encoding="utf-8"))
    ids = [node["node_id"] for node in data["nodes"]]
    assert len(set(ids)) == len(ids) == 11
    assert [i for i, n in zip(ids, graph.nodes) if n.kind == "error"] == ["0_-1_0", "0_-1_1", "1_-1_0", "1_-1_1"]
    assert {"0_0_0", "0_1_1"} <= set(ids)  # the features keep circuit-tracer's ids
    model = models.Model.model_validate(data)  # circuit-tracer's own models read it
    assert [n.node_id for n in model.nodes] == ids
    # every link names two nodes of the file, and its weight is the adjacency between those two nodes
    index = {node_id: i for i, node_id in enumerate(ids)}
    assert len(data["links"]) == int(graph.edge_mask.sum()) == 13
    for link in data["links"]:
        assert link["source"] in index and link["target"] in index
        assert link["weight"] == graph.adjacency[index[link["target"]], index[link["source"]]].item() != 0
    # circuit-tracer's own parser reads an error id as its layer, feature -1, position
    _, pinned = decode(f"https://x/graph?pinnedIds={','.join(ids[3:7])}")
    assert [tuple(f) for f in pinned] == [(0, 0, -1), (0, 1, -1), (1, 0, -1), (1, 1, -1)]  # (layer, pos, feature)


def test_json_refuses_a_graph_holding_a_node_twice():
    graph = chain_graph()
    again = [A, *range(11)]  # feature a twice, with its edges
    twice = AttributionGraph([graph.nodes[i] for i in again], graph.adjacency[again][:, again], torch.zeros(12),
                             torch.zeros(12), graph.input_ids, graph.logit_probabilities)
    with pytest.raises(InvalidArgument, match="more than once"):
        twice.json_data(node_threshold=1.0, edge_threshold=1.0)
