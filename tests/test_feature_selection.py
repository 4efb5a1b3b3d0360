"""``max_feature_nodes`` keeps the features circuit-tracer keeps: circuit-tracer 0.5's own ``attribute``
(its rounds, its ``compute_partial_influences``, which normalises each row over every column: features,
errors and embeddings) run on a stand-in replacement model whose backward passes return the rows of
qgraph's whole graph (every active feature a node), per-layer and cross-layer transcoders alike."""
from __future__ import annotations

import pytest
import torch

import qgraph
from qgraph.testing import tiny_clt, write_transcoders

attribute_module = pytest.importorskip("circuit_tracer.attribution.attribute")

PROMPT = torch.tensor([5, 17, 99, 3, 42, 7, 120])


class _Context:
    """What circuit-tracer's attribution loop reads of its context: the active features (a sparse
    ``[layers, positions, features]``), logits (only their width is read with custom targets), the
    encoder vectors it passes back to ``compute_batch`` (here each feature's index) and the rows."""

    def __init__(self, graph):
        kinds = [node.kind for node in graph.nodes]
        features = [node for node in graph.nodes if node.kind == "feature"]
        self.rows = graph.adjacency[:, :kinds.index("logit")]  # every source: features, errors, embeddings
        self.logit_nodes = [i for i, kind in enumerate(kinds) if kind == "logit"]
        index = torch.tensor([[n.layer, n.position, n.feature] for n in features]).T
        shape = (graph.n_layers, len(graph.input_ids), max(n.feature for n in features) + 1)
        self.activation_matrix = torch.sparse_coo_tensor(
            index, torch.tensor([n.activation for n in features]), shape, check_invariants=True).coalesce()
        assert torch.equal(self.activation_matrix.indices(), index)  # the graph's feature order is circuit-tracer's
        self.encoder_vecs = torch.arange(len(features), dtype=torch.float64)[:, None]
        self.logits = torch.zeros(1, len(graph.input_ids), 1)

    def compute_batch(self, layers, positions, inject_values, retain_graph=True):
        if bool((layers == self.activation_matrix.shape[0]).all()):  # logit targets: the vector is its index
            return self.rows[[self.logit_nodes[int(v)] for v in inject_values[:, 0]]]
        return self.rows[inject_values[:, 0].long()]


class _Tokenizer:
    vocab_size = 0

    def decode(self, ids) -> str:
        return " ".join(map(str, ids.tolist()))


class _ReplacementModel:
    """The parts of circuit-tracer's ``ReplacementModel`` its ``attribute`` uses, for a graph's rows."""

    def __init__(self, graph):
        self.context, self.scan, self.model_config = _Context(graph), None, None
        self.targets = [(str(n.feature), float(n.probability), torch.tensor([float(j)]))
                        for j, n in enumerate(node for node in graph.nodes if node.kind == "logit")]
        self.unembed_proj, self.tokenizer = None, _Tokenizer()

    def ensure_tokenized(self, prompt):
        return prompt

    def setup_attribution(self, input_ids):
        return self.context

    def run_forward_pass(self, input_ids, batch_size, context):
        pass


def circuit_tracers_choice(whole, max_feature_nodes: int, batch_size: int, monkeypatch, **options) -> set:
    """The (layer, position, feature) circuit-tracer 0.5's ``attribute`` keeps with ``max_feature_nodes``,
    given the rows of ``whole`` (a graph of every active feature)."""
    monkeypatch.setattr(attribute_module, "Graph", lambda **made: made)
    model = _ReplacementModel(whole)
    made = attribute_module.attribute(whole.input_ids, model, attribution_targets=model.targets,
                                      batch_size=batch_size, max_feature_nodes=max_feature_nodes, **options)
    features = [node for node in whole.nodes if node.kind == "feature"]
    return {(features[i].layer, features[i].position, features[i].feature) for i in made["selected_features"].tolist()}


def _kept(graph) -> set:
    return {(n.layer, n.position, n.feature) for n in graph.nodes if n.kind == "feature"}


@pytest.fixture(scope="module", params=["per-layer", "cross-layer"])
def whole(request, sdpa_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tc")
    if request.param == "per-layer":
        text = sdpa_model.config.get_text_config()
        transcoders = write_transcoders(folder, text.hidden_size, text.num_hidden_layers, 32, skip=True)
    else:
        transcoders = tiny_clt(folder, sdpa_model, d_transcoder=16, jumprelu=True)
    return sdpa_model, transcoders, qgraph.attribution_graph(sdpa_model, PROMPT, transcoders, batch_size=64)


@pytest.mark.parametrize("max_feature_nodes, batch_size, update_interval", [(60, 4, None), (40, 8, 1)])
def test_the_features_kept_are_circuit_tracers(whole, monkeypatch, max_feature_nodes, batch_size, update_interval):
    """circuit-tracer's choice with its defaults (4 batches between rankings) and with update_interval=1."""
    model, transcoders, graph = whole
    assert graph.count("feature") > 2 * max_feature_nodes  # a choice to make
    options = {} if update_interval is None else {"update_interval": update_interval}  # None: each one's default
    want = circuit_tracers_choice(graph, max_feature_nodes, batch_size, monkeypatch, **options)
    few = qgraph.attribution_graph(model, PROMPT, transcoders, max_feature_nodes=max_feature_nodes,
                                   batch_size=batch_size, **options)
    assert len(want) == few.count("feature") == max_feature_nodes
    assert _kept(few) == want
