"""The work a saved program can make a call do (qgraph/saved/work.py): known at load as an expression of
the call's sizes, bounded per weight at load (a graph that computes more than any model of its weights is
refused, as the chained matmuls an attacker writes are), and per call by ``max_work``."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import qgraph

from conftest import random_ids
from hostile import OPS, call, returning, rewrite, sized


@pytest.fixture(scope="module")
def program(saved_probe):
    return saved_probe


def chained(count: int, size, columns: int):
    """``count`` chained products ``[size, columns] @ [columns, columns]`` (the issue's function edit)."""
    nodes = [call(f"{OPS}.ones.default", [size, columns]), call(f"{OPS}.ones.default", [columns, columns])]
    nodes[0]["name"], nodes[1]["name"] = "hostile_x", "hostile_w"
    for index in range(count):
        nodes.append({"name": f"hostile_mm{index}", "op": "call_function", "target": f"{OPS}.mm.default",
                      "args": [{"node": "hostile_x" if index == 0 else f"hostile_mm{index - 1}"}, {"node": "hostile_w"}]})
    return nodes


def test_work_counts_what_the_call_computes(program, sdpa_model):
    """The work is at least the multiply-adds torch's own FlopCounterMode counts on the loaded program's
    call, and within a small factor of them (the rest: the elements every other op reads and writes)."""
    loaded = qgraph.load(program, weights=sdpa_model)
    for batch, length in ((1, 8), (2, 32)):
        with FlopCounterMode(display=False) as counter:
            loaded(random_ids(batch, length))
        counted = counter.get_total_flops()
        assert counted <= loaded.work(batch, length) <= 4 * counted, (batch, length)
    assert loaded.work(2, 64) > 2 * loaded.work(1, 64) * 0.99 and loaded.work(1, 128) > 2 * loaded.work(1, 64)


def test_a_call_past_max_work_is_refused_before_it_runs(program, sdpa_model):
    loaded = qgraph.load(program, weights=sdpa_model, max_work=qgraph.load(program).work(1, 8))
    torch.testing.assert_close(loaded(random_ids(1, 8)).logits, sdpa_model(random_ids(1, 8)).logits, rtol=0, atol=1e-5)
    with pytest.raises(qgraph.InvalidArgument, match=r"this call would compute [\d.e+]+ floating-point operations, "
                                                     r"more than max_work="):
        loaded(random_ids(1, 9))


@pytest.mark.parametrize("case", ["fixed", "quadratic"])
def test_work_no_model_of_its_weights_does_is_refused_at_load(program, canary, tmp_path, case):
    """The issue's 100 chained 2048 x 2048 products (1.7e12 operations at every call, whatever its size),
    and products that grow as length² x 65536: refused at load and by qgraph check, nothing run."""
    from qgraph.cli import main
    if case == "fixed":
        change, message = returning(*chained(100, 2048, 2048)), r"computes 1.7\d*e\+12 operations per 1 \(a row, a token\)"
    else:
        def change(data):
            nodes = [sized(data), call(f"{OPS}.ones.default", [{"node": "hostile_length"}, 65536]),
                     call(f"{OPS}.ones.default", [65536, {"node": "hostile_length"}])]
            nodes.append({"name": "hostile_square", "op": "call_function", "target": f"{OPS}.mm.default",
                          "args": [{"node": nodes[1]["name"]}, {"node": nodes[2]["name"]}]})
            returning(*nodes)(data)
        message = r"operations per s\d+\*\*2 \(a row, a token, a pair of tokens\)"
    bad = rewrite(program, tmp_path / f"{case}.qgraph", graph=change)
    with pytest.raises(qgraph.SavedProgramError, match=message):
        qgraph.load(bad)
    assert main(["check", str(bad)]) == 2
