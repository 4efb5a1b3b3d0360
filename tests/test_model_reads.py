"""A program's reads of the model's tensors (``qgraph.model_reads``): one batch where that is what ``getattr``
returns, ``getattr`` itself wherever it would return something else (issue 56, item 2)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import qgraph
from tests.conftest import hf_logits, random_ids


@pytest.fixture()
def model(checkpoint):
    """A load of its own: the tests change it."""
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture()
def program(model):
    return qgraph.instrument(model).program_for(False)


def _by_getattr(reads):
    return [getattr(module, name) for module, name in zip(reads.modules, reads.names)]


def _same(reads) -> bool:
    return all(a is b for a, b in zip(reads.read(), _by_getattr(reads), strict=True))


def test_a_program_reads_the_model_in_one_batch(program):
    reads, model = program.model_reads, program.model
    assert len(reads) > len(list(model.parameters())) / 2
    assert {id(t) for t in reads.read()} <= {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert reads._batch() is not None and _same(reads)


def _shadow(model):
    up = model.model.layers[1].mlp.up_proj
    up.__dict__["weight"] = up.weight.detach() * 2  # what getattr (and the model's forward) read first


def _class_attribute(model):
    up = model.model.layers[1].mlp.up_proj
    up.__class__ = type("Fixed", (type(up),), {"weight": up.weight.detach() * 2})  # read before __getattr__


def _own_getattr(model):
    up = model.model.layers[1].mlp.up_proj
    up.__class__ = type("Own", (type(up),), {"__getattr__": lambda self, name: torch.nn.Module.__getattr__(self, name)})


def _buffer_now(model):
    norm = model.model.norm
    weight = norm.weight.detach() + 1
    del norm.weight
    norm.register_buffer("weight", weight)


ELSEWHERE = {"a name in the instance __dict__": _shadow, "a class attribute of the name": _class_attribute,
             "a class of its own __getattr__": _own_getattr, "a parameter now a buffer": _buffer_now}


@pytest.mark.parametrize("change", ELSEWHERE)
def test_where_getattr_reads_elsewhere_getattr_reads(model, program, change):
    ELSEWHERE[change](model)
    reads = program.model_reads
    assert reads._batch() is None
    assert _same(reads)


def test_a_replaced_parameter_and_a_none_are_read_in_the_batch(model, program):
    up = model.model.layers[1].mlp.up_proj
    up.weight = torch.nn.Parameter(up.weight.detach() * 3)
    reads = program.model_reads
    assert reads._batch() is not None and _same(reads)
    assert any(tensor is up.weight for tensor in reads.read())


def test_a_call_reads_what_the_model_reads(model):
    """A tensor that shadows a parameter in the module's __dict__: the fingerprint does not see it (the
    parameter is still there), the model's forward reads it, and so does the program."""
    ig = qgraph.instrument(model, values=["layers.1.mlp.up_proj.output"])
    ids = random_ids(1, 6, seed=3)
    _shadow(model)
    with torch.no_grad():
        assert torch.equal(ig(ids).logits, hf_logits(model, ids))
