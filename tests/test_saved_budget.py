"""The load's budget (``saved.budget``, issue 53): a graph past the node limit is refused before any of its
nodes is read, and the fake run, the costly step of a load, runs once per kind of call, not per node: the
edit slots of every block one kind, a flood of one op one call. Counted, not timed (the figures are
benchmarks/bench_load.py's, in benchmarks/results.md)."""
from __future__ import annotations

import pytest
import torch

import qgraph
from qgraph import compat
from qgraph.saved import budget, fxdata

from hostile import OPS, call, returning, rewrite


@pytest.fixture
def fake_calls(monkeypatch):
    """The fake calls of the loads that follow (each kind of call the sandbox runs on fake tensors)."""
    calls = []
    real = compat.fake_call
    monkeypatch.setattr(compat, "fake_call", lambda target, args, kwargs: calls.append(target) or real(
        target, args, kwargs))
    return calls


def test_a_graph_one_node_past_the_limit_is_refused_before_any_node_is_read(sdpa_model, tmp_path, monkeypatch):
    program = qgraph.instrument(sdpa_model, values=["layers.1.layer_output"]).save(tmp_path / "p.qgraph", weights=True)

    def grow(data):  # filler nodes up to one past the limit, each a valid call
        nodes = data["graph"]["nodes"]
        returning(*(call(f"{OPS}.zeros.default", [index]) for index in range(budget.NODES + 1 - len(nodes))))(data)
        assert len(nodes) == budget.NODES + 1
    big = rewrite(program, tmp_path / "big.qgraph", graph=grow)
    read = []
    monkeypatch.setattr(fxdata, "_decode", lambda *args: read.append(args) or pytest.fail("a node was read"))
    monkeypatch.setattr(torch.fx.Graph, "create_node", lambda *args, **kwargs: pytest.fail("a node was built"))
    with pytest.raises(qgraph.SavedProgramError, match=r"its graph has 50,001 nodes, more than a saved program may "
                                                       r"have \(50,000\): a saved program is bounded so that loading"):
        qgraph.load(big)
    assert read == []
    assert budget.NODES == fxdata.LIMITS["nodes"] == 50_000


def test_the_fake_run_is_per_kind_of_call_not_per_node(sdpa_model, tmp_path, fake_calls):
    """An edit slot at every block's values runs no more fake calls than one slot (a slot's name does not
    change its result's shape: before, each slot was a kind of its own, 48 calls a block of the 0.8B
    program with every value), and a chain of 5,000 adds runs two (its first tensor and its first add)."""
    one = qgraph.instrument(sdpa_model, values=["layers.1.layer_output"], edits=["layers.0.layer_output"])
    every = qgraph.instrument(sdpa_model, values=["layers.1.layer_output"],
                              edits=["layers.*.layer_output", "layers.*.mlp.output", "layers.*.input_layernorm.output"])
    assert len(every.slots) == 12
    counts = []
    for name, ig in (("one", one), ("every", every)):
        path = ig.save(tmp_path / f"{name}.qgraph", weights=True)
        fake_calls.clear()
        qgraph.load(path)
        counts.append(len(fake_calls))
    assert counts[0] == counts[1]

    def chain(data):
        nodes = [{**call(f"{OPS}.zeros.default", [4]), "name": "chain0"}]
        for index in range(1, 5_000):
            nodes.append({**call(f"{OPS}.add.Tensor", {"node": nodes[-1]["name"]}, {"node": nodes[-1]["name"]}),
                          "name": f"chain{index}"})
        returning(*nodes)(data)
    grown = rewrite(tmp_path / "one.qgraph", tmp_path / "chain.qgraph", graph=chain)
    fake_calls.clear()
    qgraph.load(grown)
    assert len(fake_calls) == counts[0] + 2
