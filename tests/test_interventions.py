"""Feature interventions and graph scores, as circuit-tracer has them: the live mode against the plain HF
forward with hooks on every MLP (per-layer transcoders and a CLT), frozen attention against HF with the
sdpa and delta-rule kernels' inputs held, direct effects against the attribution graph's edges,
generation against a greedy HF loop with hooks, the scores against circuit-tracer's own function."""
from __future__ import annotations

import pytest
import torch

import qgraph
from conftest import hf_logits
from qgraph.circuits import feature_intervention, feature_intervention_generate, graph_scores
from qgraph.testing import tiny_clt, write_transcoders

PROMPT = torch.tensor([5, 17, 99, 3, 42, 7, 120])
BLOCKS = 4


@pytest.fixture(scope="module")
def per_layer(sdpa_model, tmp_path_factory):
    folder = write_transcoders(tmp_path_factory.mktemp("tc"), 64, BLOCKS, 16, skip=True)
    return {i: qgraph.Transcoder.load(folder, layer=i) for i in range(BLOCKS)}


@pytest.fixture(scope="module")
def clt(sdpa_model, tmp_path_factory):
    return qgraph.CrossLayerTranscoder.load(tiny_clt(tmp_path_factory.mktemp("clt"), sdpa_model, 16, jumprelu=True))


@pytest.fixture(scope="module")
def graph(sdpa_model, per_layer):
    return qgraph.attribution_graph(sdpa_model, PROMPT, per_layer, batch_size=64)


class Math:
    """The transcoders' math from their tensors: ``encode(block, x)``, ``write(source, target, delta)``."""

    def __init__(self, transcoders):
        self.t, self.cross = transcoders, isinstance(transcoders, qgraph.CrossLayerTranscoder)

    def encode(self, j, x):
        if self.cross:
            pre = x @ self.t.W_enc[j] + self.t.b_enc[j]
            return pre * (pre > self.t.threshold[j])
        return torch.relu(x @ self.t[j].W_enc + self.t[j].b_enc)

    def write(self, i, j, delta):
        if self.cross:
            return delta @ self.t.W_dec[i][:, j - i] if j >= i else 0
        return delta @ self.t[i].W_dec if i == j else 0


def hf_live(model, ids, math, interventions, blocks=range(BLOCKS)):
    """The HF forward, hooks on every MLP: features from the MLP's input, the intervened ones set (int
    positions, or every position from ``p`` for ``slice(p, None)``), ``(set - original) @ W_dec`` added to
    the MLP output of each block it writes. ``(logits, [features as set, per block]``)."""
    deltas, seen, handles = {}, {}, []
    for j in blocks:
        def hook(module, args, output, j=j):
            features = math.encode(j, args[0])
            delta = torch.zeros_like(features)
            for layer, position, feature, value in interventions:
                if layer == j:
                    delta[0, position, feature] = value - features[0, position, feature]
            deltas[j], seen[j] = delta, features + delta
            return output + sum(math.write(i, j, d) for i, d in deltas.items())
        handles.append(model.model.layers[j].mlp.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, torch.stack([seen[j][0] for j in blocks])


@pytest.mark.parametrize("kind", ["per_layer", "clt"])
def test_the_live_mode_is_hf_with_hooks_on_every_mlp(sdpa_model, request, kind):
    transcoders = request.getfixturevalue(kind)
    math = Math(transcoders)
    interventions = [(0, 2, 3, 4.0), (1, 5, 7, -2.5), (2, slice(4, None), 1, 3.0)]
    got = feature_intervention(sdpa_model, PROMPT, transcoders, interventions)
    as_hf = [(0, 2, 3, 4.0), (1, 5, 7, -2.5), *((2, p, 1, 3.0) for p in range(4, 7))]
    logits, features = hf_live(sdpa_model, PROMPT, math, as_hf)
    torch.testing.assert_close(got.logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.activations, features, rtol=1e-5, atol=1e-5)
    assert got.blocks == (0, 1, 2, 3) and float(got.activations[1, 5, 7]) == -2.5
    assert (got.logits - hf_logits(sdpa_model, PROMPT[None])).abs().max() > 1e-2  # it moved something
    assert repr(got) == "Intervened(logits [1, 7, 272], activations [4, 7, 16])"


def test_no_interventions_is_the_models_forward_and_a_subset_of_blocks_splices(sdpa_model, per_layer):
    plain = hf_logits(sdpa_model, PROMPT[None])
    for kwargs in ({}, {"freeze_attention": True}):
        assert torch.equal(feature_intervention(sdpa_model, PROMPT, per_layer, [], **kwargs).logits, plain)
    some = {1: per_layer[1], 3: per_layer[3]}
    got = feature_intervention(sdpa_model, PROMPT, some, [(3, -1, 2, 6.0)])
    logits, features = hf_live(sdpa_model, PROMPT, Math(per_layer), [(3, 6, 2, 6.0)], blocks=[1, 3])
    assert got.blocks == (1, 3)
    torch.testing.assert_close(got.logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.activations, features, rtol=1e-5, atol=1e-5)


def test_an_instrumented_model_is_taken_and_eager_attention_is_not_frozen(sdpa_model, eager_model, per_layer):
    ig = qgraph.instrument(sdpa_model, values=["layers.0.layer_output"])
    interventions = [(2, 3, 4, 2.0)]
    assert torch.equal(feature_intervention(ig, PROMPT, per_layer, interventions).logits,
                       feature_intervention(sdpa_model, PROMPT, per_layer, interventions).logits)
    with pytest.raises(qgraph.NotSupported, match="1 of this model's 4 blocks mix positions otherwise .*'eager'.* "
                                                  "attn_implementation='sdpa'"):
        feature_intervention(eager_model, PROMPT, per_layer, interventions, freeze_attention=True)


def _held_kernels(monkeypatch, recorded: list, replay: bool, model):
    """sdpa's queries and keys and the delta-rule kernel's queries, keys, decays and betas recorded in
    call order, or replaced by those recorded (the kernel as the module's function and, where a
    transformers release binds it on each DeltaNet at init, as that attribute)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen
    sdpa, kernel, calls = torch.nn.functional.scaled_dot_product_attention, qwen.torch_chunk_gated_delta_rule, []

    def held(*values):
        if replay:
            values = recorded[len(calls)]
        else:
            recorded.append(values)
        calls.append(1)
        return values

    def frozen_sdpa(q, k, v, *args, **kwargs):
        q, k = held(q, k)
        return sdpa(q, k, v, *args, **kwargs)

    def frozen_kernel(q, k, v, g=None, beta=None, **kwargs):
        q, k, g, beta = held(q, k, g, beta)
        return kernel(q, k, v, g=g, beta=beta, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", frozen_sdpa)
    monkeypatch.setattr(qwen, "torch_chunk_gated_delta_rule", frozen_kernel)
    for module in model.modules():
        if getattr(module, "chunk_gated_delta_rule", None) is kernel:
            monkeypatch.setattr(module, "chunk_gated_delta_rule", frozen_kernel)
    return calls


@pytest.mark.parametrize("kind", ["per_layer", "clt"])
def test_frozen_attention_is_hf_with_the_kernels_inputs_held(sdpa_model, request, monkeypatch, kind):
    transcoders = request.getfixturevalue(kind)
    interventions = [(0, 1, 3, 5.0), (2, 3, 6, 4.0)]
    got = feature_intervention(sdpa_model, PROMPT, transcoders, interventions, freeze_attention=True)
    live = feature_intervention(sdpa_model, PROMPT, transcoders, interventions)
    recorded = []
    with monkeypatch.context() as patch:
        calls = _held_kernels(patch, recorded, replay=False, model=sdpa_model)
        hf_logits(sdpa_model, PROMPT[None])
        assert len(calls) == BLOCKS  # 3 DeltaNet kernels and one sdpa
    with monkeypatch.context() as patch:
        _held_kernels(patch, recorded, replay=True, model=sdpa_model)
        logits, features = hf_live(sdpa_model, PROMPT, Math(transcoders), interventions)
    torch.testing.assert_close(got.logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.activations, features, rtol=1e-5, atol=1e-5)
    assert (got.logits - live.logits).abs().max() > 1e-3  # holding the attention changes the result


def _edges_moved(model, transcoders, graph, layers) -> None:
    """circuit-tracer's verify_feature_edges: double a feature of each of ``layers`` with every block
    constrained; every other feature's pre-activation and every logit minus the mean logit move by the
    graph's edge from it."""
    base = feature_intervention(model, PROMPT, transcoders, [], constrained_layers=range(BLOCKS),
                                apply_activation_function=False)
    features = [i for i, n in enumerate(graph.nodes) if n.kind == "feature"]
    logits = [i for i, n in enumerate(graph.nodes) if n.kind == "logit"]
    tokens = torch.tensor([graph.nodes[i].feature for i in logits])
    demeaned = lambda out: out.logits[0, -1, tokens] - out.logits[0, -1].mean()  # noqa: E731
    for layer in layers:
        source = next(i for i in features if graph.nodes[i].layer == layer)
        node = graph.nodes[source]
        doubled = [(node.layer, node.position, node.feature, 2 * node.activation)]
        moved = feature_intervention(model, PROMPT, transcoders, doubled, constrained_layers=range(BLOCKS),
                                     apply_activation_function=False)
        others = [i for i in features if i != source]  # the intervened entry shows the value set
        where = [(graph.nodes[i].layer, graph.nodes[i].position, graph.nodes[i].feature) for i in others]
        change = torch.stack([moved.activations[w] - base.activations[w] for w in where])
        torch.testing.assert_close(change, graph.adjacency[others, source], rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(demeaned(moved) - demeaned(base), graph.adjacency[logits, source],
                                   rtol=1e-3, atol=1e-4)
        assert graph.adjacency[others + logits, source].abs().max() > 1e-3
        assert float(moved.activations[node.layer, node.position, node.feature]) == pytest.approx(2 * node.activation)
    live = feature_intervention(model, PROMPT, transcoders, doubled)  # the live model responds otherwise
    assert (live.logits - moved.logits).abs().max() > 1e-3


def test_direct_effects_move_every_target_by_delta_times_its_edge(sdpa_model, per_layer, graph):
    _edges_moved(sdpa_model, per_layer, graph, (0, 1, 2))


def test_direct_effects_of_a_clt_move_every_target_by_delta_times_its_edge(sdpa_model, clt):
    """A CLT feature's delta, written into its block's MLP output and every later one's."""
    graph = qgraph.attribution_graph(sdpa_model, PROMPT, clt, batch_size=64)
    _edges_moved(sdpa_model, clt, graph, (0, 2))


def hf_greedy(model, ids, math, fixed, opened, new: int):
    """A greedy HF loop over the whole sequence each step, the hooks setting ``fixed`` and, at every
    position from p, ``opened`` ((layer, p, feature, value))."""
    sequence, steps = ids, []
    for _ in range(new):
        wanted = fixed + [(l, q, f, v) for l, p, f, v in opened for q in range(p, len(sequence))]
        logits, features = hf_live(model, sequence, math, wanted)
        steps.append(logits[0, -1])
        sequence = torch.cat([sequence, logits[0, -1].argmax()[None]])
    return sequence[len(ids):], torch.stack(steps), features


def test_generation_keeps_the_interventions_and_open_ended_ones_reach_new_tokens(sdpa_model, per_layer):
    fixed, opened = [(0, 2, 3, 4.0)], [(1, 5, 7, 6.0)]
    interventions = fixed + [(layer, slice(p, None), f, v) for layer, p, f, v in opened]
    out = feature_intervention_generate(sdpa_model, PROMPT, per_layer, interventions, max_new_tokens=5)
    once = feature_intervention(sdpa_model, PROMPT, per_layer, interventions)
    torch.testing.assert_close(out.logits[0], once.logits[0, -1], rtol=1e-5, atol=1e-5)
    tokens, logits, features = hf_greedy(sdpa_model, PROMPT, Math(per_layer), fixed, opened, 5)
    assert torch.equal(out.tokens, tokens)
    torch.testing.assert_close(out.logits, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.activations, features[:, :len(PROMPT) + 4], rtol=1e-4, atol=1e-4)
    assert out.activations.shape == (BLOCKS, len(PROMPT) + 4, 16) and bool((out.activations[1, 5:, 7] == 6.0).all())
    # fixed alone: the new tokens are not set
    closed = feature_intervention_generate(sdpa_model, PROMPT, per_layer, interventions[:1] + [(1, 5, 7, 6.0)],
                                           max_new_tokens=5)
    assert (closed.logits[1:] - out.logits[1:]).abs().max() > 1e-3


def _circuit_tracer_graph(graph, config, full=None):
    """circuit-tracer's Graph of a qgraph graph; a pruned one on its full graph's nodes, the pruned
    nodes and edges zeroed (how circuit-tracer scores a pruned graph)."""
    from circuit_tracer.attribution.targets import LogitTarget
    from circuit_tracer.graph import Graph
    source = graph if full is None else full
    adjacency = graph.adjacency if full is None else torch.zeros_like(full.adjacency)
    if full is not None:
        adjacency[graph.kept[:, None], graph.kept[None, :]] = graph.adjacency
    features = [n for n in source.nodes if n.kind == "feature"]
    logit_nodes = [n for n in source.nodes if n.kind == "logit"]
    return Graph("", source.input_ids, torch.tensor([[n.layer, n.position, n.feature] for n in features]), adjacency,
                 config, torch.arange(len(features)), torch.tensor([n.activation for n in features]),
                 [LogitTarget("", n.feature) for n in logit_nodes], source.logit_probabilities, scan="tiny")


def test_the_scores_are_circuit_tracers(sdpa_model, graph):
    pytest.importorskip("circuit_tracer")
    from circuit_tracer.graph import compute_graph_scores
    from circuit_tracer.utils.tl_nnsight_mapping import convert_nnsight_config_to_transformerlens
    config = convert_nnsight_config_to_transformerlens(sdpa_model.config)
    assert config.n_layers == BLOCKS
    full = graph.scores()
    theirs = compute_graph_scores(_circuit_tracer_graph(graph, config))
    assert full == graph_scores(graph) and full == pytest.approx(theirs, rel=1e-5)
    pruned = graph.prune(0.8, 0.9)
    assert pruned.count("error") < graph.count("error")
    theirs = compute_graph_scores(_circuit_tracer_graph(pruned, config, graph))
    assert pruned.scores() == pytest.approx(theirs, rel=1e-5)
    assert 0 < full.completeness < 1 and 0 < full.replacement < 1 and pruned.scores() != pytest.approx(full)
    replacement, completeness = full  # a tuple, as circuit-tracer's
    assert (replacement, completeness) == (full.replacement, full.completeness)


def test_bad_arguments_are_named_before_any_run(sdpa_model, per_layer, monkeypatch):
    from qgraph.circuits import intervene

    def no_run(*args, **kwargs):
        raise AssertionError("a forward ran before the arguments were checked")
    for name in ("_direct", "_frozen_attention"):
        monkeypatch.setattr(intervene, name, no_run)
    monkeypatch.setattr(intervene._Spliced, "instrument", no_run)
    some = {1: per_layer[1]}
    cases = [
        (dict(interventions=[(0, 1, 2, 1.0)], transcoders=some), qgraph.InvalidArgument,
         r"interventions\[0\]: layer 0 has no transcoder spliced: give one of the blocks \[1\]"),
        (dict(interventions=[(1, 7, 2, 1.0)]), qgraph.InvalidArgument, r"position 7 is outside the prompt's 7 tokens"),
        (dict(interventions=[(1, 0, 16, 1.0)]), qgraph.InvalidArgument, "feature 16: .* features 0 to 15"),
        (dict(interventions=[(1, 0, 2, float("nan"))]), qgraph.InvalidArgument, "value nan: .* a finite number"),
        (dict(interventions=[(1, 0, 2, "big")]), qgraph.InvalidArgument, "value 'big'"),
        (dict(interventions=[(1, 0, 2)]), qgraph.InvalidArgument, r"give a tuple \(layer, position, feature, value\)"),
        (dict(interventions=(1, 0, 2, 1.0)), qgraph.InvalidArgument, r"interventions\[0\] is 1"),
        (dict(interventions={}), qgraph.InvalidType, "a list of"),
        (dict(interventions=[(1, slice(0, 9, 2), 2, 1.0)]), qgraph.InvalidArgument, "give an int, or a slice"),
        (dict(interventions=[], constrained_layers=[0, 4]), qgraph.InvalidArgument, r"\[4\] are not blocks"),
        (dict(interventions=[], constrained_layers=[0, 1]), qgraph.NotSupported, r"every block \(range\(4\)"),
        (dict(interventions=[], constrained_layers=range(4), transcoders=some), qgraph.InvalidArgument,
         r"blocks \[0, 2, 3\] have none"),
        (dict(interventions=[], transcoders={7: per_layer[1]}), qgraph.InvalidArgument, "blocks 0 to 3"),
        (dict(interventions=[], transcoders=[per_layer[1]]), qgraph.InvalidType, "transcoders takes"),
        (dict(interventions=[], freeze_attention=1), qgraph.InvalidType, "freeze_attention takes True or False"),
        (dict(interventions=[], input_ids=torch.stack([PROMPT, PROMPT])), qgraph.InvalidArgument, "one prompt"),
    ]
    for kwargs, error, match in cases:
        kwargs = {"input_ids": PROMPT, "transcoders": per_layer, **kwargs}
        with pytest.raises(error, match=match):
            feature_intervention(sdpa_model, **kwargs)
    with pytest.raises(qgraph.NotSupported, match="live model only"):
        feature_intervention_generate(sdpa_model, PROMPT, per_layer, [], freeze_attention=True)
    with pytest.raises(qgraph.InvalidArgument, match="sets edits itself"):
        feature_intervention_generate(sdpa_model, PROMPT, per_layer, [], edits={})
