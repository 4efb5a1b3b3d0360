"""Attribution graphs through the replacement model: its logits are the model's, every target's input is
the sum of its row and its constant, and every edge is what an intervention on the frozen model moves."""
import json

import pytest
import torch
import qgraph
from qgraph.circuits.influence import influence
from qgraph.export import export_model
from qgraph.passes.replacement import EMBEDDINGS, frozen, inject_name
from qgraph.program import Program
from qgraph.testing import write_transcoders

from conftest import hf_logits

PROMPT = torch.tensor([5, 17, 99, 3, 42, 7, 120])


def _transcoders(model, folder, **options):
    text = model.config.get_text_config()
    written = write_transcoders(folder, text.hidden_size, text.num_hidden_layers, 16, **options)
    return {i: qgraph.Transcoder.load(written, layer=i) for i in range(text.num_hidden_layers)}


@pytest.fixture(scope="module")
def dense(sdpa_model, tmp_path_factory):
    """The tiny Qwen3.5 (DeltaNet blocks 0-2, attention block 3), skip transcoders, its graph."""
    transcoders = _transcoders(sdpa_model, tmp_path_factory.mktemp("tc"), skip=True)
    return sdpa_model, transcoders, qgraph.attribution_graph(sdpa_model, PROMPT, transcoders, batch_size=64)


@pytest.fixture(scope="module")
def few(dense):
    """The dense model's graph with the 20 most influential features (batches of 8)."""
    model, transcoders, _ = dense
    return qgraph.attribution_graph(model, PROMPT, transcoders, max_feature_nodes=20, batch_size=8)


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def sparse(request, sparse_model, tmp_path_factory):
    model = sparse_model(request.param)
    transcoders = _transcoders(model, tmp_path_factory.mktemp("tc"), activation="jumprelu")
    return model, transcoders, qgraph.attribution_graph(model, PROMPT, transcoders, batch_size=64)


def _frozen_program(model, transcoders):
    blocks = len(transcoders)
    program = Program(model, export_model(model, images=False))
    return program.build(["layers.0.layer_input", *(f"layers.{i}.mlp_input" for i in range(blocks))], {}, True,
                         replacement=transcoders)


def _inputs(program, transcoders, **added):
    """One row: the prompt, and zeros (or ``added``'s vectors) where sources add to the stream."""
    width = transcoders[0].d_in
    inputs = {"input_ids": PROMPT[None], "attention_mask": torch.ones(1, len(PROMPT), dtype=torch.long)}
    for name in (EMBEDDINGS, *(inject_name(i) for i in transcoders)):
        inputs[name] = added.get(name, torch.zeros(1, len(PROMPT), width))
    return inputs


def _target_inputs(graph, transcoders, logits, captured) -> torch.Tensor:
    """Every feature's pre-activation and every logit node's logit minus the mean, as the run gives them."""
    values = torch.zeros(len(graph.nodes))
    last = logits[0, -1].detach().double()
    for i, node in enumerate(graph.nodes):
        if node.kind == "feature":
            x = captured[f"layers.{node.layer}.mlp_input"][0, node.position].detach()
            values[i] = float(transcoders[node.layer].pre(x[None])[0, node.feature])
        elif node.kind == "logit":
            values[i] = float(last[node.feature] - last.mean())
    return values


def _complete(graph):
    rows = [i for i, node in enumerate(graph.nodes) if node.kind in ("feature", "logit")]
    total = graph.adjacency[rows].sum(1) + graph.constants[rows]
    scale = graph.adjacency[rows].abs().sum(1) + graph.constants[rows].abs()
    return ((total - graph.node_inputs[rows]).abs() / scale).max().item()


@pytest.mark.compat
def test_the_replacement_model_computes_the_models_logits(dense):
    model, transcoders, _ = dense
    program = _frozen_program(model, transcoders)
    logits, captured = program.run(_inputs(program, transcoders))
    torch.testing.assert_close(logits, hf_logits(model, PROMPT[None]), rtol=1e-5, atol=1e-5)
    # the features are the transcoders' own, and the error closes each MLP's output
    x = captured["layers.2.mlp_input"]
    torch.testing.assert_close(captured["replacement.2.features"], transcoders[2].encode(x))


@pytest.mark.compat
def test_every_target_is_the_sum_of_its_row_and_its_constant(dense):
    model, transcoders, graph = dense
    assert graph.count("feature") > 80 and graph.count("logit") >= 1
    assert _complete(graph) < 1e-4
    # the node inputs are the run's: a feature's pre-activation, a logit minus the mean logit
    program = _frozen_program(model, transcoders)
    logits, captured = program.run(_inputs(program, transcoders))
    expected = _target_inputs(graph, transcoders, logits, captured)
    torch.testing.assert_close(graph.node_inputs, expected, rtol=1e-5, atol=1e-5)
    # features are the active ones, logits the most likely tokens
    features = [node for node in graph.nodes if node.kind == "feature"]
    assert all(node.activation > 0 for node in features)
    probabilities = torch.softmax(logits[0, -1], -1)
    assert [node.feature for node in graph.nodes if node.kind == "logit"] == \
        probabilities.topk(graph.count("logit")).indices.tolist()


@pytest.mark.compat
def test_every_edge_is_what_an_intervention_on_the_frozen_model_moves(dense):
    """Add one source's vector again where it enters the stream, with every frozen coefficient held at
    its recorded value: each target's input moves by exactly its edge from that source."""
    model, transcoders, graph = dense
    program = _frozen_program(model, transcoders)
    base = _inputs(program, transcoders)
    recorded = {}
    with frozen(recorded):
        logits, captured = program.run(base)
    before = _target_inputs(graph, transcoders, logits, captured)
    first = next(i for i, n in enumerate(graph.nodes) if n.kind == "feature" and n.layer == 0 and n.position == 1)
    sources = [first, graph.node_index("error", 1, 2), graph.node_index("embedding", None, 0, int(PROMPT[0]))]
    width = transcoders[0].d_in
    for source in sources:
        node = graph.nodes[source]
        vector = torch.zeros(1, len(PROMPT), width)
        if node.kind == "feature":
            vector[0, node.position] = node.activation * transcoders[node.layer].W_dec[node.feature]
            name = inject_name(node.layer)
        elif node.kind == "error":
            vector[0, node.position] = captured[f"replacement.{node.layer}.error"][0, node.position]
            name = inject_name(node.layer)
        else:
            vector[0, node.position] = captured["layers.0.layer_input"][0, node.position]
            name = EMBEDDINGS
        with frozen(recorded, replay=True):
            logits, moved = program.run(_inputs(program, transcoders, **{name: vector}))
        after = _target_inputs(graph, transcoders, logits, moved)
        targets = [i for i, n in enumerate(graph.nodes) if n.kind in ("feature", "logit")]
        change, edge = (after - before)[targets], graph.adjacency[targets, source]
        assert edge.abs().max() > 1e-3  # the source reaches something
        torch.testing.assert_close(change, edge, rtol=1e-3, atol=1e-4)


def test_edges_cross_positions_through_the_deltanet_and_the_attention_and_never_go_back(dense):
    _, _, graph = dense
    # block 0 is a DeltaNet: token 0's embedding reaches block 0's features at later positions only through it
    embedding = graph.node_index("embedding", None, 0, int(PROMPT[0]))
    later0 = [i for i, n in enumerate(graph.nodes) if n.kind == "feature" and n.layer == 0 and n.position > 0]
    assert graph.adjacency[later0, embedding].abs().max() > 1e-3
    # block 3 is the gated attention: block 2's error at token 0 reaches block 3's later features through it
    error = graph.node_index("error", 2, 0)
    later3 = [i for i, n in enumerate(graph.nodes) if n.kind == "feature" and n.layer == 3 and n.position > 0]
    assert graph.adjacency[later3, error].abs().max() > 1e-3
    # causal: nothing at a later position reaches an earlier one; nothing reaches its own block's features
    for t, target in enumerate(graph.nodes):
        if target.kind != "feature":
            continue
        for s, source in enumerate(graph.nodes):
            if source.kind in ("feature", "error", "embedding") and (
                    source.position > target.position or (source.layer is not None and source.layer >= target.layer)):
                assert graph.adjacency[t, s] == 0, (target, source)


@pytest.mark.parametrize("part", ["replacement", "completeness"])
def test_the_sparse_moe_families_trace_too(sparse, part):
    model, transcoders, graph = sparse
    if part == "replacement":
        program = _frozen_program(model, transcoders)
        logits, _ = program.run(_inputs(program, transcoders))
        torch.testing.assert_close(logits, hf_logits(model, PROMPT[None]), rtol=1e-5, atol=1e-5)
    else:
        assert graph.count("feature") > 10
        assert _complete(graph) < 1e-4


def _segmented(model, transcoders, **options):
    """The graph of PROMPT (7 tokens) run in segments of 3 tokens (``circuits.segments``; 64 in use): each
    target's backward ends at its own segment."""
    from qgraph.circuits import segments
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(segments, "SEGMENT", 3)
        return qgraph.attribution_graph(model, PROMPT, transcoders, **options)


def _same_graph(cut, whole) -> None:
    """``cut`` (run in segments, maybe with fewer features) is ``whole`` (one pass) on its nodes: the same
    activations and node inputs (both from the one-pass forward), and within float32 rounding its adjacency
    and constants (the backwards') and, with every feature, the nodes' influences."""
    index = {(n.kind, n.layer, n.position, n.feature): i for i, n in enumerate(whole.nodes)}
    mapped = torch.tensor([index[(n.kind, n.layer, n.position, n.feature)] for n in cut.nodes])
    assert [n.activation for n in cut.nodes] == [whole.nodes[i].activation for i in mapped]
    assert torch.equal(cut.node_inputs, whole.node_inputs[mapped])
    scale = float(whole.adjacency.abs().max())
    torch.testing.assert_close(cut.adjacency, whole.adjacency[mapped][:, mapped], rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(cut.constants, whole.constants[mapped], rtol=1e-5, atol=1e-5 * scale)
    if len(cut.nodes) == len(whole.nodes):
        weights = torch.tensor([n.probability if n.kind == "logit" else 0.0 for n in whole.nodes])
        torch.testing.assert_close(influence(cut.adjacency, weights), influence(whole.adjacency, weights),
                                   rtol=1e-4, atol=1e-6)


def test_a_prompt_run_in_segments_gives_the_one_pass_graph(dense, few):
    """Every target's backward through the segments up to its own gives the graph of the whole-prompt
    backward: the same features chosen in the same rounds, every edge within float32 rounding."""
    model, transcoders, graph = dense
    cut = _segmented(model, transcoders, max_feature_nodes=20, batch_size=8)
    assert [n.node_id for n in cut.nodes] == [n.node_id for n in few.nodes]
    _same_graph(cut, few)
    _same_graph(cut, graph)


def test_a_targets_backward_stops_at_its_own_segment(dense):
    """A feature at position 1 (segment 0 of [0, 3), [3, 6), [6, 7)) reaches no node of a later segment; the
    last position's logits reach every segment."""
    from qgraph.circuits import attribute, segments
    model, transcoders, _ = dense
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(segments, "SEGMENT", 3)
        run = attribute.replacement_run(model, PROMPT, transcoders, 8)
    reached = set()
    for block, parts in enumerate(run.inputs):
        assert len(parts) == 3
        for segment, tensor in enumerate(parts):
            tensor.grad_fn.register_prehook(lambda grads, key=(block, segment): reached.add(key))
    active = run.active()
    feature = active[(active[:, 0] == 3) & (active[:, 1] == 1)][0]
    run.rows([("feature", tuple(feature.tolist()))])
    assert reached == {(0, 0), (1, 0), (2, 0), (3, 0)}
    reached.clear()
    run.rows([("logit", 3)])
    assert {segment for _, segment in reached} == {0, 1, 2}


def test_the_sparse_moe_families_run_in_segments_too(sparse):
    model, transcoders, graph = sparse
    cut = _segmented(model, transcoders, max_feature_nodes=8, batch_size=4)
    assert cut.count("feature") == 8
    _same_graph(cut, graph)


def test_a_pruned_graph_writes_circuit_tracers_json(dense, tmp_path):
    graph = dense[2].prune()
    path = graph.to_json(tmp_path / "graph.json", slug="tiny")
    data = json.loads(path.read_text())
    assert {node["feature_type"] for node in data["nodes"]} >= {"embedding", "logit"}
    weights = {(link["source"], link["target"]): link["weight"] for link in data["links"]}
    ids = [node.node_id for node in graph.nodes]
    t, s = graph.edges.nonzero()[0].tolist()
    assert weights[(ids[s], ids[t])] == pytest.approx(float(graph.adjacency[t, s]), rel=1e-6)
    models = pytest.importorskip("circuit_tracer.frontend.graph_models")
    models.Model.model_validate(data)


def test_every_node_of_a_whole_graph_has_its_own_id(dense, tmp_path):
    """Everything kept (prune(1.0, 1.0)): where circuit-tracer 0.5.0's ids name an error node and a layer-0
    feature alike, the file's ids are still one node's each, and every link names two of them."""
    models = pytest.importorskip("circuit_tracer.frontend.graph_models")
    graph = dense[2].prune(1.0, 1.0)
    old = [models.Node.error_node(n.layer, n.position).node_id if n.kind == "error" else n.node_id for n in graph.nodes]
    assert len(set(old)) < len(old)  # 0.5.0's scheme collides on this graph
    data = json.loads(graph.to_json(tmp_path / "whole.json").read_text())
    ids = [node["node_id"] for node in data["nodes"]]
    assert len(set(ids)) == len(ids) == len(graph.nodes)
    index = {node_id: i for i, node_id in enumerate(ids)}
    assert len(data["links"]) == int(graph.edge_mask.sum())
    for link in data["links"][::97]:
        t, s = index[link["target"]], index[link["source"]]
        assert link["weight"] == pytest.approx(float(graph.adjacency[t, s]), rel=1e-6)
    assert all(link["source"] in index and link["target"] in index for link in data["links"])
    assert [n.node_id for n in models.Model.model_validate(data).nodes] == ids


def test_fewer_feature_nodes_keep_the_most_influential(dense, few):
    model, transcoders, graph = dense
    assert few.count("feature") == 20
    kept = {(n.layer, n.position, n.feature) for n in few.nodes if n.kind == "feature"}
    # the rows it computed are the full graph's rows for those features
    for i, node in enumerate(few.nodes):
        if node.kind == "feature":
            full = graph.node_index("feature", node.layer, node.position, node.feature)
            assert few.node_inputs[i] == pytest.approx(float(graph.node_inputs[full]), rel=1e-5)
    assert len(kept) == 20


def test_the_features_kept_are_chosen_as_the_dense_rounds_choose_them(dense, tmp_path):
    """Rounds of batch_size (update_interval=1) on the full graph's rows, the influence through them by
    graph.influence on the dense square (each row normalised over every source: features, errors,
    embeddings), pick the same features as the one-pass influence over the rows; offload="disk" gives
    the same graph and leaves no file. (test_feature_selection.py checks the choice against circuit-tracer.)"""
    from qgraph.circuits.graph import influence
    model, transcoders, graph = dense
    features = [i for i, n in enumerate(graph.nodes) if n.kind == "feature"]
    logits = [i for i, n in enumerate(graph.nodes) if n.kind == "logit"]
    sources = [i for i, n in enumerate(graph.nodes) if n.kind != "logit"]
    weights = torch.tensor([graph.nodes[i].probability for i in logits])
    done: list[int] = []
    while len(done) < 20:
        square = torch.zeros(len(graph.nodes), len(graph.nodes))
        for row in logits + [features[j] for j in done]:
            square[row, sources] = graph.adjacency[row, sources]
        start = torch.zeros(len(graph.nodes))
        start[logits] = weights
        score = influence(square, start)[features]
        score[done] = -1.0
        done += score.topk(min(8, 20 - len(done))).indices.tolist()
    want = {(graph.nodes[features[j]].layer, graph.nodes[features[j]].position, graph.nodes[features[j]].feature)
            for j in done}
    for offload in (None, "disk"):
        few = qgraph.attribution_graph(model, PROMPT, transcoders, max_feature_nodes=20, batch_size=8,
                                       update_interval=1, offload=offload)
        assert {(n.layer, n.position, n.feature) for n in few.nodes if n.kind == "feature"} == want
        assert few.adjacency.shape == (len(few.nodes),) * 2 and len(few.nodes) == len(graph.nodes) - len(features) + 20
        if offload is None:
            kept = few
        else:
            assert torch.equal(few.adjacency, kept.adjacency) and torch.equal(few.constants, kept.constants)
    index = {(n.kind, n.layer, n.position, n.feature): i for i, n in enumerate(graph.nodes)}
    mapped = torch.tensor([index[(n.kind, n.layer, n.position, n.feature)] for n in kept.nodes])
    assert torch.allclose(kept.adjacency, graph.adjacency[mapped][:, mapped], rtol=1e-4, atol=1e-6)  # its edges
    with pytest.raises(qgraph.InvalidArgument, match="offload='gpu'"):
        qgraph.attribution_graph(model, PROMPT, transcoders, offload="gpu")


def test_the_estimate_counts_what_the_call_does_and_keeps_nothing(dense, monkeypatch):
    """estimate's counts are the graph's (active features, kept features, logits) and its backward passes
    the backwards the call runs, each of targets_per_pass targets at most; its own forward keeps no tensor
    for a backward; its parts add up as the module says (the rows read a bounded part at a time)."""
    from qgraph.circuits import attribute
    from qgraph.circuits.rows import READ
    model, transcoders, graph = dense
    passes = []
    original = attribute._Run._backward
    monkeypatch.setattr(attribute._Run, "_backward", lambda run, chunk: passes.append(len(chunk)) or original(run, chunk))
    for update_interval in (1, 4):
        e = qgraph.circuits.estimate(model, PROMPT, transcoders, max_feature_nodes=20, batch_size=8,
                                     update_interval=update_interval)
        assert passes == []  # the estimate ran no backward
        few = qgraph.attribution_graph(model, PROMPT, transcoders, max_feature_nodes=20, batch_size=8,
                                       update_interval=update_interval)
        assert e.backward_passes == len(passes) and max(passes) == e.targets_per_pass <= 8
        passes.clear()
    assert e.feature_nodes == few.count("feature") == 20
    assert e.logit_nodes == few.count("logit") and e.active_features == graph.count("feature")
    nodes, active, targets = len(few.nodes), e.active_features, e.logit_nodes + 20
    assert set(e.parts) == {"program", "forward", "transient", "rows", "reads", "batch", "graph"}
    assert e.parts["graph"] == 2 * nodes * nodes * 4 and e.bytes == sum(e.parts.values()) - min(
        e.parts["batch"], e.parts["graph"])
    assert e.parts["rows"] == targets * (active + 4 * 7 + 7 + 2) * 4
    assert e.parts["reads"] == min(targets, READ // active) * active * 4
    assert min(e.parts.values()) >= 0 and e.parts["forward"] > 0
    disk = qgraph.circuits.estimate(model, PROMPT, transcoders, max_feature_nodes=20, batch_size=8, offload="disk")
    assert disk.parts["rows"] == (e.logit_nodes + 20) * (4 * 7 + 7 + 2) * 4
    assert repr(e).startswith("Estimate(") and "backward passes" in repr(e)


def test_bad_requests_are_named(dense):
    model, transcoders, _ = dense
    with pytest.raises(qgraph.InvalidArgument, match=r"blocks \[3\] have none"):
        qgraph.attribution_graph(model, PROMPT, {i: transcoders[i] for i in range(3)})
    with pytest.raises(qgraph.InvalidArgument, match="one prompt"):
        qgraph.attribution_graph(model, torch.stack([PROMPT, PROMPT]), transcoders)
    with pytest.raises(qgraph.InvalidArgument, match="desired_logit_prob"):
        qgraph.attribution_graph(model, PROMPT, transcoders, desired_logit_prob=0)
    with pytest.raises(qgraph.InvalidArgument, match="update_interval takes a positive int"):
        qgraph.circuits.estimate(model, PROMPT, transcoders, update_interval=0)


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_ids_outside_the_vocabulary_are_refused_as_an_instrumented_call_refuses_them(sdpa_model, monkeypatch, bad):
    """An id past the vocabulary or -1: the error an instrumented call gives for the same ids (its type and
    message, naming the id and the embedding's rows), raised before any work (nothing exported or run, not
    even the transcoders looked at)."""
    from qgraph.circuits import attribute

    vocab = sdpa_model.get_input_embeddings().num_embeddings
    bad = vocab if bad == "vocab" else bad
    ids = PROMPT.clone()
    ids[3] = bad
    ig = qgraph.instrument(sdpa_model, values=["layers.0.layer_output"], logits=False)
    with pytest.raises(qgraph.QgraphError) as from_call:
        ig(ids[None])

    def no_work(*args, **kwargs):
        raise AssertionError("the replacement model ran before the ids were checked")
    monkeypatch.setattr(attribute, "replacement_run", no_work)
    for given in (ids, ids[None]):
        with pytest.raises(qgraph.InvalidArgument) as from_graph:
            qgraph.attribution_graph(sdpa_model, given, transcoders={})
        assert type(from_graph.value) is type(from_call.value)
        assert str(from_graph.value) == str(from_call.value)
        message = str(from_graph.value)
        assert f"hold {bad}," in message and f"{vocab} rows" in message and f"0 to {vocab - 1}" in message
    with pytest.raises(IndexError):  # what the embedding itself says for the same id, with no check before it
        sdpa_model.get_input_embeddings()(ids)
