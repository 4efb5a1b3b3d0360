"""Function edits as data (qgraph.serve.function): exported on the client, loaded on the server. A round trip
computes what the function computes, for any batch and length; a function that cannot travel is refused on
the client, naming the edit and torch's reason; hand-made data is refused at load with a qgraph error, and
nothing it names ran (a canary file, torch's classes' attributes)."""
from __future__ import annotations

import copy
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import qgraph
from qgraph.serve.function import DYNAMIC, LIMITS, export_function, load_function
from qgraph.serve.wire import pack, parse

DIMS = ("batch", "seq", "hidden_size")
OPS = "torch.ops.aten"


def travel(data: dict, tensors: dict) -> tuple[dict, dict]:
    """Through the serving body and JSON, as the server gets them."""
    call, got = parse(pack({"edit": data}, tensors))
    return json.loads(json.dumps(call["edit"])), got


def sent(fn, value=None, dims=DIMS, name="layers.1.layer_output"):
    data, tensors = export_function(fn, torch.randn(2, 5, 16) if value is None else value, dims, name)
    return load_function(*travel(data, tensors), name)


def test_a_round_trip_computes_what_the_function_does_at_other_sizes():
    def fn(x):
        return torch.tanh(x) * 0.5 + x.mean(-1, keepdim=True) - x.amax(1, keepdim=True)

    loaded = sent(fn)
    for shape in [(3, 7, 16), (1, 1, 16), (5, 2, 16), (2, 300, 16)]:
        x = torch.randn(shape)
        assert torch.allclose(loaded(x), fn(x), atol=1e-6), shape


def test_the_reductions_a_researcher_reaches_for_travel():
    """A norm, a standard deviation and a log-sum-exp (``linalg_vector_norm``, ``std.dim``, ``logsumexp``:
    refused before they joined the list with their reason) compute what they do locally."""
    def fn(x):
        return x / x.norm(dim=-1, keepdim=True) + x.std(-1, keepdim=True) - torch.logsumexp(x, -1, keepdim=True) \
            + x.var(1, keepdim=True)

    loaded = sent(fn)
    for shape in [(3, 7, 16), (1, 1, 16)]:
        x = torch.randn(shape)
        torch.testing.assert_close(loaded(x), fn(x), rtol=0, atol=1e-5, equal_nan=True)


def test_it_runs_on_a_slice_of_the_batch_cropped_to_a_length():
    heads = lambda x: x.view(*x.shape[:2], 4, 4).transpose(-1, -2).reshape(x.shape) * 2  # noqa: E731
    loaded = sent(heads)
    batch = torch.randn(4, 9, 16)
    x = batch[1:3, :5]  # one request's rows and length: not contiguous
    assert not x.is_contiguous() and torch.equal(loaded(x), heads(x.contiguous()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no cuda device")
def test_exported_on_the_cpu_it_runs_on_the_value_s_cuda_device():
    vector = torch.randn(16)
    loaded = sent(lambda x: x + torch.ones(16) + vector)
    x = torch.randn(3, 7, 16)
    got = loaded(x.cuda())
    assert got.device.type == "cuda" and torch.allclose(got.cpu(), x + 1 + vector)


def test_a_closure_over_a_steering_vector_holds_its_values():
    vector = torch.randn(16)
    data, tensors = export_function(lambda x: x + 3.0 * vector, torch.randn(2, 5, 16), DIMS, "steer")
    assert [t.tolist() for t in tensors.values()] == [vector.tolist()]  # the vector itself travels
    assert data["placeholders"] == [{"shape": ["batch", "seq", 16], "dtype": "float32", "device": "cpu"}]
    assert data["symbols"] == {"batch": {"min": 1, "max": DYNAMIC["batch"]}, "seq": {"min": 1, "max": DYNAMIC["seq"]}}
    loaded = load_function(*travel(data, tensors), "steer")
    x = torch.randn(3, 7, 16)
    assert torch.equal(loaded(x), x + 3.0 * vector)
    vector.zero_()  # what was sent is a copy: the server's edit does not follow the client's tensor
    assert torch.equal(loaded(x), x + 3.0 * tensors["held0"])


def test_a_module_its_weights_and_the_dtype_travel():
    torch.manual_seed(0)
    probe = torch.nn.Linear(16, 16).to(torch.bfloat16)
    loaded = sent(lambda x: x - probe(x), torch.randn(2, 5, 16, dtype=torch.bfloat16))
    x = torch.randn(4, 9, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(loaded(x), x - probe(x))
    with pytest.raises(qgraph.EditError, match=r"exported for bfloat16 values \[batch seq hidden_size\]"):
        loaded(x.float())


def test_an_attention_pattern_s_query_and_key_are_both_dynamic():
    dims = ("batch", "heads", "query", "key")
    causal = lambda x: torch.softmax(x.masked_fill(torch.ones_like(x, dtype=torch.bool).triu(1), -1e9), -1)  # noqa: E731
    loaded = sent(causal, torch.randn(2, 4, 5, 5), dims)
    x = torch.randn(3, 4, 7, 7)
    assert torch.allclose(loaded(x), causal(x))
    with pytest.raises(qgraph.EditError, match=r"shape \['batch', 4, 'query', 'key'\]; this value is .*\(3, 2, 7, 7\)"):
        loaded(torch.randn(3, 2, 7, 7))  # heads is fixed


def test_in_place_work_on_its_own_tensors_is_made_functional():
    def fn(x):
        y = x.clone()
        y.add_(1.0)
        return y

    loaded = sent(fn)
    x = torch.randn(3, 7, 16)
    assert torch.equal(loaded(x), x + 1.0)


def test_a_device_the_graph_names_is_the_value_s():
    data, tensors = export_function(lambda x: x + torch.ones(16) * 2, torch.randn(2, 5, 16), DIMS, "ones")
    text = json.dumps(data)
    assert '{"device": "cpu"}' in text  # torch.ones writes its device
    data = json.loads(text.replace('"cpu"', '"cuda:7"'))  # a client's device this server lacks
    x = torch.randn(2, 3, 16)
    assert torch.equal(load_function(data, tensors, "ones")(x), x + 2)


def test_a_call_outside_the_bounds_is_refused():
    data, tensors = export_function(lambda x: x * 2, torch.randn(2, 5, 16), DIMS, "double")
    data["symbols"]["seq"]["max"] = 8
    loaded = load_function(data, tensors, "double")
    assert torch.equal(loaded(torch.ones(1, 8, 16)), torch.full((1, 8, 16), 2.0))
    with pytest.raises(qgraph.InvalidArgument, match="at most 8 along dim 1"):
        loaded(torch.ones(1, 9, 16))
    with pytest.raises(qgraph.EditError, match="this value is torch.float32 \\(1, 8, 15\\)"):
        loaded(torch.ones(1, 8, 15))


def test_functions_exported_from_many_threads_at_once_each_compute_their_own():
    """torch.export is not thread-safe ("Trying to pop empty mode stack"): the exports run one at a time."""
    fns = [lambda x, k=k: x * (k + 2) + torch.tanh(x) * k - x.mean(1, keepdim=True) for k in range(6)]
    start, stderr = threading.Barrier(len(fns)), sys.stderr

    def export(fn):
        start.wait()
        return sent(fn)

    with ThreadPoolExecutor(len(fns)) as pool:
        loaded = list(pool.map(export, fns))
    x = torch.randn(3, 7, 16)
    for fn, function in zip(fns, loaded):
        assert torch.allclose(function(x), fn(x), atol=1e-6)
    assert sys.stderr is stderr  # no export's quieting redirect of stderr was left behind


# -- refused on the client ---------------------------------------------------------------------------


@pytest.mark.parametrize("fn, reason", [
    (lambda x: x * 2 if x.sum() > 0 else x, r"torch.export cannot export it \(Could not guard on data-dependent"),
    (lambda x: x[..., :8], r"it returned \(2, 3, 8\) for a value of shape \(2, 3, 16\)"),
    (lambda x: x.mean().item(), r"it returned float"),
    (lambda x: (x, x), r"it returned tuple"),
    (lambda x: x.mul_(2), r"it writes a tensor in place \(user_input_mutation\)"),
    (lambda x: torch.special.bessel_j0(x), r"'aten::special_bessel_j0', which is not on the positive list of what a "
                                           r"saved program or a function edit may call \(the docs' page 'What a "
                                           r"program may call'.*write it with the ops listed there"),
    (lambda x: x + torch.randn(3, 16), r"Constraints violated \((seq|L\['value'\]\.size\(\)\[1\])\).*it must work for any"),
    (lambda x: x[:, 2, None].expand_as(x).clone(), r"fails on a value of shape \(1, 1, 16\).*index 2 out of range"),
    (lambda x: x.nonexistent(), r"it raised AttributeError"),
], ids=["data-dependent branch", "wrong shape", "not a tensor", "two tensors", "writes its input", "op off the list",
        "fixes the length", "needs a length", "raises"])
def test_a_function_that_cannot_travel_is_refused_on_the_client_with_the_reason(fn, reason):
    with pytest.raises(qgraph.EditError, match=reason) as caught:
        export_function(fn, torch.randn(2, 5, 16), DIMS, "layers.3.layer_output")
    message = str(caught.value)
    assert message.startswith("the function edit 'layers.3.layer_output' cannot be sent to the server")
    assert "use qgraph.Replace, Add, Scale or Zero" in message and "torch ops only" in message


def test_arguments_of_the_wrong_kind_are_refused_on_the_client():
    with pytest.raises(qgraph.EditError, match="is int"):
        export_function(3, torch.randn(2, 5, 16), DIMS, "e")
    with pytest.raises(qgraph.EditError, match="floating tensor laid out as"):
        export_function(lambda x: x, torch.randn(2, 5), DIMS, "e")


# -- hand-made data, refused on the server --------------------------------------------------------------


@pytest.fixture(scope="module")
def good():
    vector = torch.randn(16)
    return export_function(lambda x: x + vector, torch.randn(2, 5, 16), DIMS, "good")


@pytest.fixture
def canary(tmp_path):
    """A file a hostile graph would write, and what must not change in torch's classes."""
    secret = tmp_path / "secret.txt"
    before = dict(vars(torch.nn.Module)), dict(vars(torch.fx.GraphModule))
    yield secret
    assert not secret.exists() and list(tmp_path.iterdir()) == []
    assert dict(vars(torch.nn.Module)) == before[0] and dict(vars(torch.fx.GraphModule)) == before[1]


def call(name, target, *args, **kwargs):
    return {"name": name, "op": "call_function", "target": target, "args": list(args),
            **({"kwargs": kwargs} if kwargs else {})}


def returning(*nodes):
    """A change of the data: ``nodes`` before its output, the last one returned."""
    def change(data, tensors):
        graph = data["graph"]["nodes"]
        graph[-1:] = [*nodes, {"name": "output", "op": "output", "args": [{"node": nodes[-1]["name"]}]}]
    return change


def placeholder(data):
    return next(node["name"] for node in data["graph"]["nodes"] if node["op"] == "placeholder")


def deep(levels: int):
    nested = 1
    for _ in range(levels):
        nested = [nested]
    return nested


def test_the_canary_is_live(tmp_path):
    """The hostile graphs' code, run as fx would run it, writes the canary: its absence means nothing ran."""
    secret = tmp_path / "secret.txt"
    graph = torch.fx.Graph()
    graph.output(graph.call_function(eval, (f"open({str(secret)!r}, 'w').write('pwned')",)))
    torch.fx.GraphModule({}, graph)()
    assert secret.read_text() == "pwned"


def graph_cases(secret):
    code = f"open({str(secret)!r}, 'w').write('pwned')"
    value = {"node": "value"}
    return [
        ("eval", returning(call("hostile", "builtins.eval", code)), r"calls 'builtins.eval' .* not on the positive list"),
        ("exec", returning(call("hostile", "builtins.exec", code)), "builtins.exec"),
        ("os.system", returning(call("hostile", "os.system", f"touch {secret}")), "os.system"),
        ("subprocess", returning(call("hostile", "subprocess.Popen", ["touch", str(secret)])), "subprocess.Popen"),
        ("aten.save", returning(call("hostile", f"{OPS}.save.default", str(secret))), "save.default"),
        ("a dunder", returning(call("hostile", "torch.ops.aten.__class__", value)), "__class__"),
        ("copy_ into the value", returning(call("hostile", f"{OPS}.copy_.default", value, value)),
         "writes in place into its input value"),
        ("the held tensor returned", returning({"name": "hostile", "op": "get_attr", "target": "held0"}),
         "returns its held tensor held0"),
        ("a get_attr of something not given", returning({"name": "hostile", "op": "get_attr", "target": "secret"}),
         "reads secret, a tensor the file does not hold"),
        ("a get_attr along a path", returning({"name": "hostile", "op": "get_attr", "target": "__class__.__init__"}),
         "a held tensor's name is a flat identifier"),
        ("a get_attr of the module's own", returning({"name": "hostile", "op": "get_attr", "target": "graph"}),
         "a held tensor's name is a flat identifier"),
        ("a method call", returning({"name": "hostile", "op": "call_method", "target": "__reduce__", "args": [value]}),
         "of kind 'call_method'"),
        ("a module call", returning({"name": "hostile", "op": "call_module", "target": "fn", "args": [value]}),
         "of kind 'call_module'"),
        ("random numbers", returning(call("hostile", f"{OPS}.dropout.default", value, 0.5, True)),
         "train=True; a saved program holds it only with train=False"),
        ("a scalar returned", returning(call("hostile", f"{OPS}.sum.default", value)),
         r"returns a torch.float32 tensor of shape \[\]; a function edit returns"),
        ("another shape returned", returning(call("hostile", f"{OPS}.transpose.int", value, 0, 1)),
         "returns a torch.float32 tensor of shape"),
        ("length cubed", returning(
            call("n", f"{OPS}.sym_size.int", value, 1), call("n2", "operator.mul", {"node": "n"}, {"node": "n"}),
            call("hostile", f"{OPS}.zeros.default", [{"node": "n2"}, {"node": "n"}, {"node": "n"}])),
         "grows faster with the call's sizes"),
        ("arguments nested deep", returning(call("hostile", f"{OPS}.add.Tensor", value, [[[[[[[[[[[1]]]]]]]]]]])),
         "nested deeper than"),
        ("arguments nested past the stack", returning(call("hostile", f"{OPS}.add.Tensor", value, deep(5000))),
         "nested too deep"),
        ("a node that does not fit", returning(call("hostile", f"{OPS}.mm.default", value, value)),
         r"node hostile \(aten.mm.default\) does not fit its arguments"),
    ]


def field_cases():
    """(case, change of (data, tensors), what the refusal says)."""
    def setting(path, value):
        def change(data, tensors):
            *parents, last = path
            for key in parents:
                data = data[key]
            data[last] = value
        return change

    def two_placeholders(data, tensors):
        data["graph"]["nodes"].insert(0, {"name": "other", "op": "placeholder"})

    def many_nodes(data, tensors):
        data["graph"]["nodes"][1:1] = [call(f"n{i}", f"{OPS}.neg.default", {"node": "value"})
                                       for i in range(LIMITS["nodes"])]

    return [
        ("an extra field", setting(["code"], "print('x')"), "not an object of exactly"),
        ("a format as a string", setting(["format"], "1"), "its field 'format' is not 1: '1'"),
        ("a format as a bool", setting(["format"], True), "its field 'format' is not 1: True"),
        ("dims as a string", setting(["dims"], "batch seq"), "field 'dims' is not 1 to 8 distinct names"),
        ("a dim not a name", setting(["dims"], ["batch", "seq", "hidden size"]), "field 'dims' is not 1 to 8"),
        ("a bound past the server's", setting(["symbols", "seq", "max"], 2**40), "within their bounds"),
        ("a bound as a bool", setting(["symbols", "batch", "min"], True), "within their bounds"),
        ("a symbol too many", setting(["symbols", "hidden_size"], {"min": 1, "max": 4}), "for exactly its dims"),
        ("the length fixed", setting(["placeholders", 0, "shape", 1], 5), "gives its input a shape not its dims'"),
        ("a size negative", setting(["placeholders", 0, "shape", 2], -16), "gives its input a shape not its dims'"),
        ("a size huge", setting(["placeholders", 0, "shape", 2], 2**40), "gives its input a shape not its dims'"),
        ("an integer input", setting(["placeholders", 0, "dtype"], "int64"), "field 'placeholders' is not exactly one input"),
        ("two inputs declared", setting(["placeholders"], [{}, {}]), "not exactly one input"),
        ("two placeholders", two_placeholders, "its graph has 2 inputs; a function edit takes one"),
        ("too many nodes", many_nodes, "more than a function edit may have"),
        ("nodes not a list", setting(["graph"], {"nodes": "all"}), r"field 'graph' is not \{nodes"),
        ("a tensor declared huge", setting(["tensors", "held0"], {"shape": [2**24, 2**24], "dtype": "float32"}),
         "field 'tensors' holds more than 16,777,216 elements"),
        ("a tensor of a dtype off the list", setting(["tensors", "held0", "dtype"], "complex64"), "field 'tensors' is not at most 64"),
        ("a held name with a path", setting(["tensors"], {"a.b": {"shape": [16], "dtype": "float32"}}),
         "field 'tensors' is not at most 64"),
        ("a tensor given of another shape", lambda d, t: t.update(held0=torch.zeros(17)), r"not the float32 \[16\]"),
        ("a tensor given not declared", lambda d, t: t.update(extra=torch.zeros(1)), "other tensors than its data"),
        ("a tensor given as a list", lambda d, t: t.update(held0=[0.0] * 16), r"not the float32 \[16\]"),
        ("a node of unknown keys", lambda d, t: d["graph"]["nodes"][0].update(code="x"), "not an object of name"),
    ]


def _cases(secret):
    return graph_cases(secret) + field_cases()


@pytest.mark.parametrize("case", [case for case, _, _ in _cases("secret")])
def test_hostile_data_is_refused_at_load_and_nothing_it_names_runs(good, canary, case):
    change, reason = next((change, reason) for name, change, reason in _cases(canary) if name == case)
    data, tensors = copy.deepcopy(good[0]), dict(good[1])
    change(data, tensors)
    with pytest.raises(qgraph.QgraphError, match=reason) as caught:
        load_function(data, tensors, "layers.1.layer_output")
    assert isinstance(caught.value, (qgraph.SavedProgramError, qgraph.EditError, qgraph.InvalidArgument))
    assert "the function edit 'layers.1.layer_output'" in str(caught.value)


@pytest.mark.parametrize("data", [None, [], "graph", {"format": 1}], ids=repr)
def test_data_that_is_no_object_of_the_fields_is_refused(data):
    with pytest.raises(qgraph.SavedProgramError, match="not an object of exactly"):
        load_function(data, {}, "e")
