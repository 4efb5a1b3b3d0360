"""The eager forward a call runs (``qgraph.direct``): the program's own code, each operator called at its
C++ entry point, with the same values, the same refusals, and no Python frame per op (issue 56, item 2)."""
from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

import qgraph
from qgraph import direct
from tests.conftest import random_ids


@pytest.fixture(scope="module")
def program(sdpa_model):
    ig = qgraph.instrument(sdpa_model, values=["layers.*.layer_output", "layers.3.self_attn.attention_scores"],
                           edits=["layers.1.layer_output"])
    return ig.program_for(False)


def _arguments(program):
    ids = random_ids(2, 7, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return program.arguments({"input_ids": ids, "attention_mask": mask})


def test_the_direct_forward_returns_what_the_module_returns(program):
    args = _arguments(program)
    with torch.no_grad():
        expected, got = program.module(*args), direct.forward(program.module)(*args)
    assert len(got) == len(expected) > 5
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_no_python_frame_per_op(program):
    """The module's forward enters ``OpOverload.__call__`` for each op; the direct forward never does."""
    overload_call = type(torch.ops.aten.add.Tensor).__call__.__code__
    entered = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is overload_call:
            entered.append(1)

    args, counts = _arguments(program), []
    with torch.no_grad():
        for run in (program.module, direct.forward(program.module)):
            entered.clear()
            sys.setprofile(profile)
            try:
                run(*args)
            finally:
                sys.setprofile(None)
            counts.append(len(entered))
    assert counts[0] > 100 and counts[1] == 0


def test_the_metadata_check_refuses_what_the_op_refuses():
    x = torch.zeros(2, 3)
    check, op = direct._assert_tensor_metadata, torch.ops.aten._assert_tensor_metadata.default
    cpu = torch.device("cpu")
    assert check(x, dtype=torch.float32, device=cpu, layout=torch.strided) is None
    for kwargs in ({"dtype": torch.float64}, {"dtype": torch.float32, "layout": torch.sparse_coo},
                   {"size": [2, 4]}):
        with pytest.raises(RuntimeError) as ours:
            check(x, **kwargs)
        with pytest.raises(RuntimeError) as theirs:
            op(x, **kwargs)
        assert str(ours.value) == str(theirs.value)
    assert check(x, size=[2, 3], stride=[3, 1], dtype=torch.float32) is None  # the op decides, and passes


def test_a_recompiled_module_gets_a_new_forward():
    module = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    x = torch.tensor([-1.0, 2.0])
    assert torch.equal(direct.forward(module)(x), torch.tensor([0.0, 2.0]))
    output = module.graph.output_node()
    with module.graph.inserting_before(output):
        doubled = module.graph.call_function(torch.ops.aten.mul.Tensor, (output.args[0], 2.0))
    output.args = (doubled,)
    module.recompile()
    assert torch.equal(direct.forward(module)(x), torch.tensor([0.0, 4.0]))


def test_the_module_is_not_kept_alive():
    module = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    direct.forward(module)(torch.ones(2))
    alive = weakref.ref(module)
    assert module in direct._FORWARDS
    del module
    gc.collect()
    assert alive() is None
