"""Saved programs as an attacker writes them: each hostile rewrite of a ``.qgraph`` archive is refused at
``qgraph.load`` with a ``SavedProgramError`` naming the field or node, and nothing was read, written or
changed (a canary file's bytes and its folder, ``torch.nn.Module``'s and ``GraphModule``'s attributes, the
process's peak memory). The sandbox's own bounds at call time, and the positive list's promises (every op on
it pure, registered, and written by ``ig.save``), are tested here too (docs/security.md)."""
from __future__ import annotations

import json
import random
import zipfile

import pytest
import torch

import qgraph
from qgraph.saved import allowed, budget, fxdata, sandbox

from conftest import random_ids
from hostile import OPS, call, example_size, first_weight, ids_input, nodes_of, returning, rewrite, sized


@pytest.fixture(scope="module")
def program(saved_probe):
    return saved_probe


def graph_cases(secret):
    """(case, change of graph.json, what the refusal says)."""
    path = str(secret)
    empty = {"name": "buf", "op": "call_function", "target": f"{OPS}.empty.memory_format", "args": [[0]],
             "kwargs": {"dtype": {"dtype": "uint8"}}}

    def lazy(make):  # a change that needs the graph's own names
        return lambda data: returning(*make(data))(data)

    def power(data):
        size, nodes = {"node": "hostile_length"}, [sized(data)]
        for index in range(4):
            nodes.append({"name": f"hostile_p{index}", "op": "call_function", "target": "operator.mul",
                          "args": [size, {"node": "hostile_length"}]})
            size = {"node": f"hostile_p{index}"}
        return nodes + [call(f"{OPS}.zeros.default", [size])]

    def chain(step, count, first=None):  # sizes made from the call's length by ``step(previous, name)``
        def make(data):
            size, nodes = {"node": "hostile_length"}, [sized(data)]
            for index in range(count):
                nodes.append({"name": f"hostile_c{index}", "op": "call_function", **step(size, index)})
                size = {"node": f"hostile_c{index}"}
            return nodes + [call(f"{OPS}.zeros.default", [size])]
        return lazy(make)

    def length_plus(*offsets):  # the call's length plus each offset, and a tensor of those dims
        return lazy(lambda d: [sized(d), *({"name": f"hostile_plus{i}", "op": "call_function", "target": "operator.add",
                                            "args": [{"node": "hostile_length"}, i]} for i in offsets),
                               call(f"{OPS}.zeros.default", [{"node": f"hostile_plus{i}"} for i in offsets])])

    def fibonacci(data):  # c = a * b + 1, then a, b = b, c: sympy's work on each grows like its expansion
        a, b, nodes = {"node": "hostile_length"}, {"node": "hostile_length"}, [sized(data)]
        for index in range(0, 40, 2):
            nodes += [{"name": f"hostile_f{index}", "op": "call_function", "target": "operator.mul", "args": [a, b]},
                      {"name": f"hostile_f{index + 1}", "op": "call_function", "target": "operator.add",
                       "args": [{"node": f"hostile_f{index}"}, 1]}]
            a, b = b, {"node": f"hostile_f{index + 1}"}
        return nodes + [call(f"{OPS}.zeros.default", [b])]

    square = lambda size, index: {"target": "operator.mul", "args": [size, size]}  # noqa: E731
    numbers = random.Random(0)
    kinds = [call(f"{OPS}.zeros.default", [size]) for size in range(budget.CALLS + 1)]
    return [
        # what would take minutes or memory without end to check (saved.budget): refused at the node
        ("a size squared 60 times", chain(square, 60), r"node hostile_c2 \(operator.mul\) makes a size of s\d+\*\*8 "),
        ("sizes multiplied into each other", lazy(fibonacci), r"node hostile_f\d+ \(operator.\w+\) makes a size of "
                                                              r".* terms multiplied out"),
        ("a product of sums (reshaped, expanded by sympy)", length_plus(1, 2, 3),
         r"makes a size of .*\(s\d+ \+ 1\).* 8 terms multiplied out"),
        ("a size to the power 2**62", lazy(lambda d: [sized(d), call("operator.pow", {"node": "hostile_length"}, 2**62)]),
         r"raises a size to the power 4611686018427387904"),
        ("an int past int64", returning(call("operator.mul", 2**62, 2**62)), r"computes the number 2126764793255865"),
        ("an unbind of a million", lazy(lambda d: [{**call(f"{OPS}.zeros.default", [2**20]), "name": "hostile_long"},
                                                   call(f"{OPS}.unbind.int", {"node": "hostile_long"})]),
         r"\(aten.unbind.int\) makes 1,048,576 tensors, past the 1,024 kinds of op call"),
        ("a tensor of 17 dims", returning(call(f"{OPS}.zeros.default", [1] * 17)), "makes a tensor of 17 dims"),
        ("more kinds of call than the budget", returning(*kinds), r"past the 1,024 kinds of op call a saved program"),
        ("more argument items than the budget", returning(*(call(f"{OPS}.sum.dim_IntList", [numbers.randrange(10**6) for _
                                                                                    in range(2**16)]) for _ in range(4))),
         r"past 200,000 argument items"),
        ("nested lists past the JSON's budget", returning(call(f"{OPS}.cat.default", [[[]] * 2**16] * 7)),
         r"graph.json holds 4[\d,]+ JSON lists and objects, more than a saved program's \(400,000\)"),
        ("from_file reads a file", returning(empty, call(f"{OPS}.from_file.out", path, False, 25, out={"node": "buf"})),
         r"calls 'torch.ops.aten.from_file.out' .* not on the positive list"),
        ("from_file, the functional form", returning(call(f"{OPS}.from_file.default", path, True, 25)),
         "from_file.default"),
        ("save writes a file", returning(call(f"{OPS}.save.default", path)), "save.default"),
        ("_print prints", returning(call(f"{OPS}._print.default", "pwned")), "_print.default"),
        ("an out= variant", lazy(lambda d: [call(f"{OPS}.add.out", {"node": first_weight(d)}, {"node": first_weight(d)},
                                                 out={"node": first_weight(d)})]), "add.out"),
        ("an in-place op outside the list", lazy(lambda d: [call(f"{OPS}.mul_.Scalar", {"node": first_weight(d)}, 0.0)]),
         "mul_.Scalar"),
        ("copy_ into a weight", lazy(lambda d: [call(f"{OPS}.copy_.default", {"node": first_weight(d)},
                                                     {"node": first_weight(d)})]),
         r"writes in place into its input p_model_embed_tokens_weight"),
        ("index_put_ into a view of a held tensor", lazy(lambda d: [
            {"name": "hostile_view", "op": "call_function", "target": f"{OPS}.view.default",
             "args": [{"node": nodes_of(d, "get_attr")[0]["name"]}, [-1]]},
            call(f"{OPS}.index_put_.default", {"node": "hostile_view"}, [None], {"node": "hostile_view"})]),
         r"writes in place into its held tensor"),
        ("a view of a weight returned", lazy(lambda d: [call(f"{OPS}.t.default", {"node": first_weight(d)})]),
         r"returns its input p_model_embed_tokens_weight \(or a view of it\)"),
        ("a held tensor returned", lazy(lambda d: [call(f"{OPS}.alias.default", {"node": nodes_of(d, "get_attr")[0]["name"]})]),
         r"returns its held tensor"),
        ("a _foreach op", lazy(lambda d: [call(f"{OPS}._foreach_add.Scalar", [{"node": first_weight(d)}], 1.0)]),
         "_foreach_add.Scalar"),
        ("random numbers", returning(call(f"{OPS}.rand.default", [4])), "rand.default"),
        ("dropout that draws", lazy(lambda d: [call(f"{OPS}.dropout.default", {"node": first_weight(d)}, 0.5, True)]),
         r"with train=True; a saved program holds it only with train=False"),
        ("a higher-order op", returning(call("torch.ops.higher_order.wrap_with_set_grad_enabled", False)),
         "wrap_with_set_grad_enabled"),
        ("a TorchScript builtin", returning(call("torch._C._jit_get_operation", "aten::add")), "_jit_get_operation"),
        ("a dunder op name", returning(call(f"{OPS}.__class__.__init__")), r"'torch.ops.aten.__class__.__init__'"),
        ("an empty tensor of 2**40 bytes", returning(call(f"{OPS}.empty.memory_format", [2**40],
                                                          dtype={"dtype": "uint8"})),
         r"makes a tensor of 1,099,511,627,776 bytes at the smallest call"),
        ("a huge symbolic product", lazy(power), r"grows faster with the call's sizes"),
        ("a guard fixing the call's length to the sandbox's example", lazy(lambda d: [  # then nothing would bound it
            {"name": "hostile_row", "op": "call_function", "target": f"{OPS}.select.int", "args": [{"node": ids_input(d)}, 0, 0]},
            call(f"{OPS}.view.default", {"node": "hostile_row"}, [example_size(d, "seq")])]),
         r"fixes the call's size 'seq' to \d+, the sandbox's example"),
        ("a node that does not fit its op", lazy(lambda d: [call(f"{OPS}.linear.default", {"node": first_weight(d)},
                                                                 {"node": ids_input(d)})]), "does not fit its arguments"),
        ("a device this machine lacks", lazy(lambda d: [call(f"{OPS}.to.device", {"node": first_weight(d)},
                                                             {"device": "cuda:0"}, {"dtype": "float32"})]),
         "names the device 'cuda:0', which this machine does not have"),
        ("a dotted attribute path", lambda d: nodes_of(d, "get_attr")[0].update(target="__class__.__base__.__base__.X"),
         "a held tensor's name is a flat identifier"),
        ("a leading underscore", lambda d: nodes_of(d, "get_attr")[0].update(target="_parameters"),
         "a held tensor's name is a flat identifier"),
        ("a graph module's attribute", lambda d: nodes_of(d, "get_attr")[0].update(target="forward"),
         "a held tensor's name is a flat identifier"),
        ("a unicode name", lambda d: nodes_of(d, "call_function")[0].update(name="lineаr"), "has a node named"),
        ("code as a node name", lambda d: nodes_of(d, "call_function")[0].update(name="x = __import__('os')"),
         "has a node named"),
        ("a subgraph of its own", lambda d: d["graph"].update(modules={"body": {"nodes": []}}),
         "not an object holding only a list of nodes"),
        ("an unknown kind of node", lambda d: nodes_of(d, "call_function")[0].update(op="call_module"), "of kind"),
        ("a target that is no name", lambda d: nodes_of(d, "call_function")[0].update(target=["operator", "mul"]),
         "which is not on the positive list"),
    ]


def test_hostile_graphs_are_refused_at_load_and_nothing_ran(program, canary, sdpa_model, monkeypatch):
    for index, (case, change, message) in enumerate(graph_cases(canary)):
        bad = rewrite(program, canary.parent.parent / f"case{index}.qgraph", graph=change)
        with pytest.raises(qgraph.SavedProgramError, match=message):
            qgraph.load(bad)
            pytest.fail(f"{case}: loaded")
    assert not hasattr(torch.nn.Module, "X")
    monkeypatch.setitem(fxdata.LIMITS, "nodes", 100)
    with pytest.raises(qgraph.SavedProgramError, match=r"nodes, more than a saved program may have \(100\)"):
        qgraph.load(program)


def test_hostile_fields_and_members_are_refused_at_load(program, canary, tmp_path):
    versions = json.loads(zipfile.ZipFile(program).read("qgraph.json"))["versions"]
    (tmp_path.parent / "outside.safetensors").write_bytes(b"")  # what ".." would reach
    cases = [
        (dict(meta=lambda m: m.update(weights="..")), r"field 'weights' is not null or the name of a .safetensors"),
        (dict(meta=lambda m: m.update(weights="/etc/passwd")), "field 'weights'"),
        (dict(meta=lambda m: m.update(weights="../outside.safetensors")), "field 'weights'"),
        (dict(meta=lambda m: m.pop("slots")), r"field 'slots' is missing"),
        (dict(meta=lambda m: m.update(versions={k: v for k, v in versions.items() if k != "torch"})),
         "does not name the torch that wrote it"),
        (dict(meta=lambda m: m.update(model_type="evil_remote_code")), r"field 'model_type' names no model_type"),
        (dict(meta=lambda m: m.update(family="other")), r"field 'family' names no family"),
        (dict(meta=lambda m: m["config"].update(__class__="str")), "field 'config'"),
        (dict(meta=lambda m: m.update(derived={"x": {"how": "exec", "sources": []}})), "derives 'x' by 'exec'"),
        (dict(meta=lambda m: m.update(blocks="4")), r"field 'blocks' is not the number of blocks"),
        (dict(graph=lambda g: g["tensors"][next(iter(g["tensors"]))].update(device="cuda:0")),
         "which this machine does not have"),
        (dict(graph=lambda g: g["tensors"][next(iter(g["tensors"]))].update(shape=[5])), r"is \[4\] float32, graph.json says \[5\]"),
        (dict(tensors={"b_model_rotary_emb_inv_freq": torch.zeros(4, dtype=torch.float64)}), r"is \[4\] float64"),
        (dict(graph=lambda g: g["placeholders"][0].update(shape=[9, 9])), "shapes the parameter model.embed_tokens.weight"),
        (dict(graph=lambda g: g["inputs"].__setitem__(0, {"parameter": "not.a.parameter"})), "field 'inputs'"),
        (dict(graph=lambda g: g.update(symbols={})), "field 'placeholders'"),
        (dict(members={"evil.py": b"import os"}), r"holds 'evil.py', which a saved program does not have"),
        (dict(members={"graph.json ": b"{}"}), "which a saved program does not have"),
    ]
    for index, (change, message) in enumerate(cases):
        bad = rewrite(program, tmp_path / f"field{index}.qgraph", **change)
        with pytest.raises(qgraph.SavedProgramError, match=message):
            qgraph.load(bad)


def test_an_inflating_member_is_refused_before_it_is_read(program, canary, tmp_path):
    bomb = tmp_path / "bomb.qgraph"
    with zipfile.ZipFile(program) as source, zipfile.ZipFile(bomb, "w") as target:
        for item in source.infolist():
            if item.filename != "qgraph.json":
                target.writestr(item, source.read(item))
                continue
            info = zipfile.ZipInfo("qgraph.json")
            info.compress_type = zipfile.ZIP_DEFLATED
            with target.open(info, "w", force_zip64=True) as member:
                member.write(source.read(item))
                for _ in range(300):  # 300 MB of spaces after the JSON, written a MB at a time
                    member.write(b" " * 2**20)
    assert bomb.stat().st_size < 2**20
    with pytest.raises(qgraph.SavedProgramError, match=r"its qgraph.json inflates to 314,[\d,]+ bytes from"):
        qgraph.load(bomb)


def test_a_call_past_the_memory_is_refused_before_it_runs(program, canary, tmp_path, sdpa_model):
    """A tensor of length² × C bytes: within the degree, small at the smallest call, refused by the
    call that would make it larger than this machine's memory (and nothing allocated)."""
    limit = sandbox.memory_limit(torch.device("cpu"))
    columns = limit // (4 * 3 * 3) + 1  # float32: past the memory at 3 tokens, not at 1
    bad = rewrite(program, tmp_path / "grows.qgraph", graph=lambda d: returning(
        sized(d), {"name": "hostile_square", "op": "call_function", "target": "operator.mul",
                   "args": [{"node": "hostile_length"}, {"node": "hostile_length"}]},
        call(f"{OPS}.empty.memory_format", [{"node": "hostile_square"}, columns]))(d))
    loaded = qgraph.load(bad, weights=sdpa_model)
    with pytest.raises(qgraph.InvalidArgument, match=r"this call would make a tensor of [\d.,]+ GiB .* more than the "
                                                     r"memory of cpu"):
        loaded(random_ids(1, 3))


def test_the_positive_list_is_pure_and_registered():
    """Every op on the list resolves in this torch; none takes a random generator unless its
    argument is pinned (CONSTANT) nor writes unless it is INPLACE; none is an out= overload."""
    import qgraph.kernels  # noqa: F401 (registers qgraph's ops)
    for name in allowed.OPS:
        op = fxdata._resolve(f"torch.ops.{name}")
        assert op is not None, name
        schema = op._schema
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        assert writes == (name in allowed.INPLACE), name
        assert (torch.Tag.nondeterministic_seeded in op.tags) == (name in allowed.CONSTANT), name
        assert not name.endswith(".out") and "_foreach" not in name, name
    with pytest.raises(qgraph.NotSupported, match="not on the positive list"):
        fxdata.target_name(torch.ops.aten.from_file.default)


def test_qgraph_check_says_each_refusal_in_one_line(program, canary, tmp_path, capsys):
    """``qgraph check FILE`` runs load's checks without weights: one line for a good file, one error
    line (exit 2, no traceback) for hostile ones (every fourth case: each refusal itself is tested at load)."""
    from qgraph.cli import main
    assert main(["check", str(program)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "a Qwen3_5ForCausalLM program of" in out[0] and "every op on the positive list" in out[0]
    for index, (case, change, message) in enumerate(graph_cases(canary)[::4]):
        bad = rewrite(program, tmp_path / f"cli{index}.qgraph", graph=change)
        assert main(["check", str(bad)]) == 2, case
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("qgraph: error: ") and "Traceback" not in err[0], (case, err)
