"""Aliasing in saved programs, decided by construction (qgraph/saved/aliasing.py): only the ops of
``allowed.FRESH`` make new storage, every other op's result aliases all it was given. Each op of FRESH is run
on the arguments most likely to hand back an input; every way the issue found (and a few more) of writing
into, or handing out, the caller's weights, inputs or the program's held tensors is refused at load and by
``qgraph check``, and the weights, the inputs and the file's bytes are the same afterwards."""
from __future__ import annotations

import hashlib

import pytest
import torch

import qgraph
from qgraph.saved import allowed

from hostile import OPS, call, first_weight, ids_input, nodes_of, returning, rewrite

x, y = torch.randn(4, 6), torch.randn(4, 6)
ints, mask = torch.arange(4), torch.ones(4, 6, dtype=torch.bool)
square = torch.randn(6, 6)


class kw:
    """A call's arguments with keywords: ``kw(x, dtype=torch.float32)``."""

    def __init__(self, *args, **kwargs):
        self.args = args, kwargs

    def __repr__(self):
        return f"kw{self.args}"


def cases():
    """op -> the calls most likely to return an input itself (no-op sizes, identity arguments, one operand)."""
    unary = "abs ceil cos erf exp expm1 floor log log1p neg reciprocal relu round rsqrt sigmoid sign silu sin sqrt " \
            "tanh gelu softplus isinf isnan logical_not bitwise_not clone lift_fresh_copy zeros_like ones_like " \
            "empty_like".split()
    table = {f"{name}.default": [(x,), (ints,)] if name not in ("bitwise_not", "logical_not") else [(mask,), (ints,)]
             for name in unary}
    table["bitwise_not.default"], table["gelu.default"] = [(mask,), (ints,)], [(x,)]
    for name in ("sqrt", "rsqrt", "log", "log1p", "erf", "expm1", "sigmoid", "silu", "softplus", "reciprocal",
                 "cos", "sin", "exp", "tanh"):
        table[f"{name}.default"] = [(x,)]
    for name in ("add", "sub", "mul", "div", "rsub", "remainder", "eq", "ne", "lt", "le", "gt", "ge"):
        table[f"{name}.Scalar"] = [(x, 0 if name in ("add", "sub", "rsub") else 1)]
        table[f"{name}.Tensor"] = [(x, torch.zeros(())), (x, torch.ones(()))] if name != "rsub" else [(x, torch.zeros(()))]
    table["rsub.Scalar"] = [(x, 0)]
    for name in ("__and__", "__or__", "__xor__", "bitwise_and", "bitwise_or", "bitwise_xor"):
        table[f"{name}.Tensor"] = [(mask, mask), (ints, ints)]
    for name in ("logical_and", "logical_or", "maximum", "minimum"):
        table[f"{name}.default"] = [(x, x), (mask, mask)]
    table.update({
        "div.Tensor_mode": [kw(x, torch.ones(()), rounding_mode=None), kw(ints, torch.ones((), dtype=torch.long), rounding_mode="floor")], "floor_divide.default": [(ints, torch.ones((), dtype=torch.long))],
        "pow.Tensor_Scalar": [(x, 1), (x, 1.0)], "pow.Tensor_Tensor": [(x, torch.ones(()))], "pow.Scalar": [(1.0, x)],
        "clamp.default": [(x, None, 1e9), (x, -1e9, None)], "clamp_min.default": [(x, -1e9)],
        "clamp_max.default": [(x, 1e9)], "lerp.Scalar": [(x, x, 0.0), (x, y, 1.0)],
        "_softmax.default": [(x, -1, False)], "_log_softmax.default": [(x, -1, False)], "softmax.int": [(x, -1)],
        "log_softmax.int": [(x, -1)], "where.self": [(mask, x, y)], "where.Scalar": [(mask, 1.0, 0.0)],
        "where.ScalarOther": [(mask, x, 0.0)], "where.ScalarSelf": [(mask, 0.0, x)],
        "masked_fill.Scalar": [(x, ~mask, 0.0)], "masked_fill.Tensor": [(x, ~mask, torch.zeros(()))],
        "sum.default": [(x,)], "sum.dim_IntList": [(x, []), (x, [0]), (torch.randn(1, 6), [0])],
        "mean.default": [(x,)], "mean.dim": [(x, [0]), (torch.randn(1, 6), [0], True)],
        "amax.default": [(x, [0])], "amin.default": [(x, [0])], "max.dim": [(x, 0)], "min.dim": [(x, 0)],
        "max.default": [(x,)], "min.default": [(x,)], "argmax.default": [(x,)], "argmin.default": [(x,)],
        "any.default": [(mask,)], "any.dim": [(mask, 0)], "all.default": [(mask,)], "all.dim": [(mask, 0)],
        "topk.default": [(x, 6)], "sort.default": [(x,)], "argsort.default": [(x,)], "cumsum.default": [(x, 0)],
        "cummax.default": [(x, 0), (ints, 0)],
        "prod.dim_int": [(torch.randn(1, 6), 0)], "var.correction": [(x, [1])], "norm.ScalarOpt_dim": [(x, 2, [1])],
        "var.dim": [(x, [1])], "std.dim": [(x, [1])], "logsumexp.default": [(x, [1]), (torch.randn(1, 6), [0])],
        "linalg_vector_norm.default": [(x, 2, [1], True), (torch.randn(6, 1), 2, [1], True)],
        "linear.default": [(x, torch.eye(6))], "matmul.default": [(x, torch.eye(6)), (torch.randn(6), torch.eye(6))],
        "mm.default": [(x, torch.eye(6))], "bmm.default": [(x[None], torch.eye(6)[None])],
        "addmm.default": [kw(x, x, torch.zeros(6, 6), beta=1, alpha=0)],
        "baddbmm.default": [kw(x[None], x[None], torch.zeros(1, 6, 6), beta=1, alpha=0)],
        "conv1d.default": [(x[None], torch.ones(4, 1, 1), None, [1], [0], [1], 4)],
        "embedding.default": [(square, torch.arange(6))],
        "scaled_dot_product_attention.default": [(x[None, None], x[None, None], x[None, None])],
        "clone.default": [(x,)], "repeat.default": [(x, [1, 1])], "repeat_interleave.self_int": [(x, 1)],
        "tril.default": [(x, 10)], "triu.default": [(x, -10)], "cat.default": [([x],), ([x, x[:0]],)],
        "stack.default": [([x],)], "index.Tensor": [(x, [ints]), (x, [None, torch.arange(6)])],
        "index_select.default": [(x, 0, ints)], "gather.default": [(x, 0, torch.zeros(4, 6, dtype=torch.long))],
        "scatter.src": [(x, 0, torch.zeros(0, 6, dtype=torch.long), y)], "scatter.value": [(x, 0, torch.zeros(0, 6, dtype=torch.long), 1.0)],
        "scatter_add.default": [(x, 0, torch.zeros(0, 6, dtype=torch.long), y)],
        "index_put.default": [(x, [torch.zeros(0, dtype=torch.long)], torch.zeros(()))],
        "constant_pad_nd.default": [(x, [0, 0]), (x, [])], "pad.default": [(x, [0, 0])],
        "one_hot.default": [(ints, 4)], "new_empty.default": [(x, [4, 6])],
        "new_full.default": [(x, [4, 6], 0.0)], "new_ones.default": [(x, [4, 6])], "new_zeros.default": [(x, [4, 6])],
        "full_like.default": [(x, 0.0)], "sign.default": [(x,), (ints,)], "round.default": [(x,), (ints,)],
    })
    table["_to_copy.default"] = [(x,), kw(x, dtype=torch.float32)]
    return table


def storages(value):
    if isinstance(value, torch.Tensor):
        return [value.untyped_storage().data_ptr()] if value.untyped_storage().nbytes() else []
    if isinstance(value, (list, tuple)):
        return [p for item in value for p in storages(item)]
    return []


def test_every_fresh_op_returns_new_storage():
    """Each aten op the sandbox takes to make new storage does, on every argument set here; the table
    names every one of them (a new op on FRESH needs its cases)."""
    table = cases()
    made = {f"aten.{name}" for name in table}
    fresh = {name for name in allowed.FRESH if name.startswith("aten.")}
    makers = {f"aten.{name}" for name in ("arange.default", "arange.start", "arange.start_step", "zeros.default",
                                          "ones.default", "full.default", "empty.memory_format", "scalar_tensor.default")}
    assert fresh - makers == made - makers, (sorted(fresh - makers - made), sorted(made - fresh))
    for name, calls in table.items():
        op = getattr(getattr(torch.ops.aten, name.split(".")[0]), name.split(".")[1])
        for case in calls:
            args, kwargs = case.args if isinstance(case, kw) else (case, {})
            given = set(storages(list(args) + list(kwargs.values())))
            assert not set(storages(op(*args, **kwargs))) & given, (name, case)


def test_the_ops_that_hand_back_their_input_are_not_fresh():
    """What the issue found, and the ops found searching the list, do hand back their input here: so
    they stay off FRESH."""
    a = torch.ops.aten
    found = {"_unsafe_view.default": a._unsafe_view.default(x, [24]), "type_as.default": a.type_as.default(x, x),
             "to.dtype": a.to.dtype(x, torch.float32), "contiguous.default": a.contiguous.default(x),
             "dropout.default": a.dropout.default(x, 0.5, False), "einsum.default": a.einsum.default("ij->ij", [x]),
             "split.Tensor": a.split.Tensor(x, 2)[0], "unbind.int": a.unbind.int(x)[0], "movedim.int": a.movedim.int(x, 0, 0),
             "reshape.default": a.reshape.default(x, [24]), "expand_as.default": a.expand_as.default(x, x)}
    for name, result in found.items():
        assert result.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), name
        assert f"aten.{name}" in allowed.OPS and f"aten.{name}" not in allowed.FRESH, name


@pytest.fixture(scope="module")
def program(saved_probe):
    return saved_probe


def held(data):
    return nodes_of(data, "get_attr")[0]["name"]


def node(name, target, *args):
    return {"name": name, "op": "call_function", "target": f"{OPS}.{target}", "args": list(args)}


def write_through(make, of):
    """A graph change that makes ``hostile_a = make(x)`` of the tensor ``of(data)`` names and writes 1000 at
    its index 0, as the issue's ``index_put_(_unsafe_view(weight, ...), [zeros([1])], full([1], 1000.))``."""
    def change(data):
        zero = {**node("hostile_zero", "zeros.default", [1]), "kwargs": {"dtype": {"dtype": "int64"}}}
        returning(*make({"node": of(data)}), zero, node("hostile_fill", "full.default", [1], 1000.0),
                  call(f"{OPS}.index_put_.default", {"node": "hostile_a"}, [{"node": "hostile_zero"}],
                       {"node": "hostile_fill"}))(data)
    return change


VIEWS = {  # how an attacker reaches the tensor's storage: each makes node hostile_a from ref
    "_unsafe_view": lambda ref: [node("hostile_a", "_unsafe_view.default", ref, [-1])],
    "type_as itself": lambda ref: [node("hostile_a", "type_as.default", ref, ref)],
    "an item of split": lambda ref: [node("hostile_list", "split.Tensor", ref, 1),
                                     {"name": "hostile_a", "op": "call_function", "target": "operator.getitem",
                                      "args": [{"node": "hostile_list"}, 0]}],
    "an item of unbind": lambda ref: [node("hostile_list", "unbind.int", ref),
                                      {"name": "hostile_a", "op": "call_function", "target": "operator.getitem",
                                       "args": [{"node": "hostile_list"}, 0]}],
    "dropout in eval mode": lambda ref: [node("hostile_a", "dropout.default", ref, 0.5, False)],
    "a one-operand einsum": lambda ref: [node("hostile_a", "einsum.default", "...->...", [ref])],
    "contiguous": lambda ref: [node("hostile_a", "contiguous.default", ref)],
    "to its own dtype": lambda ref: [{**node("hostile_a", "to.dtype", ref), "args": [ref, {"dtype": "float32"}]}],
}


def hostile_cases():
    """(case, graph change, what the refusal says)."""
    found = []
    for how, make in VIEWS.items():
        found.append((f"a write into a weight through {how}", write_through(make, first_weight),
                      r"writes in place into its input p_model_embed_tokens_weight"))
    found.append(("a write into input_ids through _unsafe_view", write_through(VIEWS["_unsafe_view"], ids_input),
                  r"writes in place into its input input_ids"))
    found.append(("a write into the held inv_freq through _unsafe_view", write_through(VIEWS["_unsafe_view"], held),
                  r"writes in place into its held tensor"))
    for how in ("_unsafe_view", "an item of unbind", "dropout in eval mode"):
        found.append((f"a weight handed out through {how}",
                      lambda data, make=VIEWS[how]: returning(*make({"node": first_weight(data)}))(data),
                      r"returns its input p_model_embed_tokens_weight \(or a view of it\)"))
    return found


def fingerprint(model, path, ids):
    return ([hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
             for t in model.state_dict().values()], ids.tolist(), path.read_bytes())


def test_writes_and_views_past_the_annotations_are_refused_at_load(program, canary, sdpa_model, tmp_path):
    """Every case loads, runs and writes on the old sandbox; here each is a SavedProgramError at load
    (gradients on for every other case, off for the rest) and at ``qgraph check`` (every fourth), and the
    weights, the input ids and the files are byte-identical."""
    from qgraph.cli import main
    ids = torch.tensor([[34, 155, 11]])
    before = fingerprint(sdpa_model, program, ids)
    for index, (case, change, message) in enumerate(hostile_cases()):
        bad = rewrite(program, tmp_path / f"alias{index}.qgraph", graph=change)
        kept = bad.read_bytes()
        with torch.set_grad_enabled(index % 2 == 0), pytest.raises(qgraph.SavedProgramError, match=message):
            qgraph.load(bad, weights=sdpa_model)(ids)
            pytest.fail(f"{case}: loaded and ran")
        if index % 4 == 0:  # the same refusal through the command line (one line, exit 2)
            assert main(["check", str(bad)]) == 2, case
        assert bad.read_bytes() == kept, case
    assert fingerprint(sdpa_model, program, ids) == before
    torch.testing.assert_close(qgraph.load(program, weights=sdpa_model)(ids).logits, sdpa_model(ids).logits,
                               rtol=0, atol=1e-5)


def test_an_index_past_the_end_at_the_call_is_a_saved_program_error(program, sdpa_model, tmp_path):
    """The sandbox cannot know an index the graph computes; the call's IndexError is the file's, named."""
    def change(data):
        index = {**node("hostile_index", "full.default", [1], 1000), "kwargs": {"dtype": {"dtype": "int64"}}}
        returning(node("hostile_a", "zeros.default", [4]), index, node("hostile_fill", "ones.default", [1]),
                  call(f"{OPS}.index_put_.default", {"node": "hostile_a"}, [{"node": "hostile_index"}],
                       {"node": "hostile_fill"}))(data)
    loaded = qgraph.load(rewrite(program, tmp_path / "past.qgraph", graph=change), weights=sdpa_model)
    with pytest.raises(qgraph.SavedProgramError, match=r"past.qgraph indexes past the end of a tensor at this call "
                                                       r"\(index 1000 is out of bounds"):
        loaded(torch.tensor([[34, 155, 11]]))
