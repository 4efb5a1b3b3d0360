"""Helpers that write hostile saved programs: a copy of a ``.qgraph`` archive with its graph.json,
qgraph.json, held tensors or members changed as an attacker would (tests/test_saved_hostile.py,
tests/test_saved_aliasing.py)."""
from __future__ import annotations

import json
import zipfile

import safetensors.torch

from qgraph.saved import sandbox


def rewrite(path, out, graph=None, meta=None, members=None, tensors=None):
    """A copy of the saved program ``path`` at ``out``, its graph.json / qgraph.json changed in place by
    ``graph(data)`` / ``meta(data)``, its held tensors replaced by ``tensors``, ``members`` added."""
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(out, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            change = {"graph.json": graph, "qgraph.json": meta}.get(item.filename)
            if change is not None:
                loaded = json.loads(data)
                change(loaded)
                data = json.dumps(loaded).encode()
            if item.filename == "tensors.safetensors" and tensors is not None:
                data = safetensors.torch.save(tensors)
            target.writestr(item, data)
        for name, data in (members or {}).items():
            target.writestr(name, data, compress_type=zipfile.ZIP_DEFLATED)
    for weights in path.parent.glob(f"{path.stem}*.safetensors*"):
        (out.parent / weights.name.replace(path.stem, out.stem, 1)).write_bytes(weights.read_bytes())
    return out


def call(target, *args, **kwargs):
    return {"name": f"hostile_{len(args)}_{abs(hash((target, str(args)))) % 10**8}", "op": "call_function",
            "target": target, "args": list(args), **({"kwargs": kwargs} if kwargs else {})}


def returning(*nodes):
    """A change of graph.json adding ``nodes`` before the output, the last one returned too."""
    def change(data):
        graph = data["graph"]["nodes"]
        output = graph.pop()
        graph.extend(nodes)
        output["args"][0]["tuple"].append({"node": nodes[-1]["name"]})
        graph.append(output)
    return change


def nodes_of(data, op):
    return [node for node in data["graph"]["nodes"] if node["op"] == op]


def first_weight(data):
    return nodes_of(data, "placeholder")[0]["name"]


def ids_input(data):
    return nodes_of(data, "placeholder")[[item.get("input") for item in data["inputs"]].index(0)]["name"]


def sized(data):
    """A size node of the call's length (sym_size of input_ids, dim 1), as the hostile graphs use."""
    return {"name": "hostile_length", "op": "call_function", "target": "torch.ops.aten.sym_size.int",
            "args": [{"node": ids_input(data)}, 1]}


def example_size(data, name):
    """The size the sandbox's fake run gives the symbol ``name`` (``sandbox._hint``, in its order)."""
    names = list(dict.fromkeys(size for spec in data["placeholders"] for size in spec["shape"] if isinstance(size, str)))
    limits = data["symbols"][name]
    return sandbox._hint(limits["min"], limits["max"], names.index(name))


OPS = "torch.ops.aten"
