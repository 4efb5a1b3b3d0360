"""An fx graph as JSON data, and back: what a saved program's ``graph.json`` holds.

``graph_data(module, tensors)`` writes each node of ``module.graph`` as ``{"name", "op", "target",
"args", "kwargs"}``; node references, tuples, dtypes, devices, layouts, memory formats, slices and
``...`` are tagged one-key objects (``{"node": "linear_3"}``, ``{"tuple": [...]}``, ``{"dtype":
"float32"}``), numbers, strings, booleans, None and lists are themselves. The tensors ``get_attr``
nodes read go to ``tensors`` (the file's safetensors). Node meta is not saved: nothing runs on it.

A target is saved by name and read back from the positive list of ``saved.allowed``, never imported:
an op overload it names (looked up in torch's op registry) or the size arithmetic export writes. Names,
placeholders and keywords must be identifiers; a held tensor's name is a flat one the writer made (no
dots, no leading ``_``), so fx sets it on the loaded module itself, never along a path out of it.
Literals are bounded (``LIMITS``) and a device must be one this machine has. Anything else refuses the
file by name (``SavedProgramError``): ``graph_from_data`` builds nodes and nothing in the file runs.
``saved.sandbox`` then checks what the graph does with them.
"""
from __future__ import annotations

import keyword
from typing import TypeGuard

import torch
from torch.fx import Graph, GraphModule, Node

from ..errors import NotSupported, SavedProgramError
from . import budget
from .allowed import FUNCTIONS, OPS

OP_OVERLOAD = type(torch.ops.aten.add.Tensor)  # the class of every registered op's overload
_BY_ID = {id(function): name for name, function in FUNCTIONS.items()}
_KINDS = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}
# int: an int64 (a slice to the end); the graph's nodes and argument items: saved.budget's, from the load's budget
LIMITS = {"nodes": budget.NODES, "items": budget.ITEMS, "list": 65_536, "string": 4_096, "depth": 8, "int": 2**63}


# -- writing ---------------------------------------------------------------------------------------


def target_name(target) -> str:
    """The positive list's name of a ``call_function`` target (``NotSupported`` for any other)."""
    name: str | None
    if isinstance(target, OP_OVERLOAD):
        name = f"torch.ops.{target}"  # str(op) is "aten.linear.default"
    else:
        name = _BY_ID.get(id(target))
    if name is None or _resolve(name) is not target:
        raise NotSupported(f"the program calls {getattr(target, '__qualname__', target)!r}, which is not on the "
                           f"positive list of what a saved program or a function edit may call (the docs' page "
                           f"'What a program may call', qgraph.saved.allowed.OPS: each group with its reason); "
                           f"write it with the ops listed there")
    return name


def held_name(name: object) -> TypeGuard[str]:
    """A name a held tensor may have: a flat identifier, no leading ``_``, not an attribute of a graph module."""
    return _name(name) and not name.startswith("_") and not hasattr(GraphModule, name)


def graph_data(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict:
    """``module.graph`` as JSON data (``module`` holds what it reads); the tensors its ``get_attr`` nodes
    read go into ``tensors``, by their (flat) names."""
    nodes = []
    graph: Graph = module.graph  # a graph module's, or the draft's that save writes (never compiled)
    for node in graph.nodes:
        item = {"name": node.name, "op": node.op}
        if node.op == "call_function":
            item["target"] = target_name(node.target)
        elif node.op == "get_attr":
            item["target"] = node.target
            held = _attribute(module, node.target)
            if not isinstance(held, torch.Tensor) or not held_name(node.target):
                raise NotSupported(f"the program's node {node.name} reads {node.target} (a {type(held).__name__}): "
                                   f"a saved program holds tensors, by flat names")
            tensors[node.target] = held
        elif node.op not in ("placeholder", "output"):
            raise NotSupported(f"the program's node {node.name} is a {node.op} of {node.target!r}: a saved program "
                               f"holds calls of ops only")
        if node.args:
            item["args"] = [_encode(arg, node) for arg in node.args]
        if node.kwargs:
            item["kwargs"] = {key: _encode(value, node) for key, value in node.kwargs.items()}
        nodes.append(item)
    return {"nodes": nodes}


def _attribute(module: torch.nn.Module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _encode(value, node: Node):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Node):
        return {"node": value.name}
    if isinstance(value, list):
        return [_encode(item, node) for item in value]
    if isinstance(value, tuple):
        return {"tuple": [_encode(item, node) for item in value]}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    for kind, cls in _KINDS.items():
        if isinstance(value, cls):
            return {kind: str(value).removeprefix("torch.")}
    if isinstance(value, slice):
        return {"slice": [_encode(part, node) for part in (value.start, value.stop, value.step)]}
    if value is Ellipsis:
        return {"ellipsis": None}
    raise NotSupported(f"the program's node {node.name} takes a {type(value).__name__} ({value!r}), which a saved "
                       f"program cannot hold")


# -- reading ---------------------------------------------------------------------------------------


def _resolve(name: object):
    """The operation a name of the positive list stands for, or None. Ops are looked up in torch's
    registry (attribute lookups on ``torch.ops``); nothing is imported."""
    if not isinstance(name, str):
        return None  # first: a file's JSON list would fail the lookup below with a TypeError, not be refused
    if name in FUNCTIONS:
        return FUNCTIONS[name]
    if not name.startswith("torch.ops.") or name[len("torch.ops."):] not in OPS:
        return None
    namespace, op, overload = name[len("torch.ops."):].split(".")
    try:
        found = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        return None  # not registered in this torch (qgraph's kernels are, on import of qgraph.kernels)
    return found if isinstance(found, OP_OVERLOAD) else None


def graph_from_data(data: dict, tensors: dict[str, torch.Tensor], where: str) -> GraphModule:
    """The graph module of ``graph_data``'s ``data``, its ``get_attr`` nodes reading ``tensors``; a name
    outside the positive list, a literal past ``LIMITS`` or a device this machine lacks refuses the file
    (``where`` names it)."""
    graph, attributes = graph_parts(data, tensors, where)
    return GraphModule(attributes, graph)


def unbuilt(graph: Graph, attributes: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module holding ``attributes`` whose ``graph`` is ``graph``, no code generated for it: what the
    sandbox runs on fake tensors before ``GraphModule(attributes, graph)`` compiles it (a refused graph's
    code is never generated: a line of it costs ~6 KiB at its compilation's peak)."""
    module = torch.nn.Module()
    for name, tensor in attributes.items():
        setattr(module, name, tensor)
    module.graph = graph
    return module


def graph_parts(data: dict, tensors: dict[str, torch.Tensor], where: str) -> tuple[Graph, dict[str, torch.Tensor]]:
    """``graph_from_data``'s graph and the tensors its ``get_attr`` nodes read, its code not generated; a
    graph past ``LIMITS["nodes"]`` nodes is refused before any node is read."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or set(data) != {"nodes"}:
        raise SavedProgramError(f"{where}: its graph.json's graph is not an object holding only a list of nodes")
    if len(data["nodes"]) > LIMITS["nodes"]:
        raise SavedProgramError(f"{where}: its graph has {len(data['nodes']):,} nodes, more than a saved program may "
                                f"have ({LIMITS['nodes']:,}): {budget.WHY}")
    nodes: dict[str, Node] = {}
    attributes: dict[str, torch.Tensor] = {}
    graph, items = Graph(), [0]
    for item in data["nodes"]:
        if not isinstance(item, dict) or not set(item) <= {"name", "op", "target", "args", "kwargs"}:
            raise SavedProgramError(f"{where}: a node of its graph is not an object of name, op, target, args and "
                                    f"kwargs: {str(item)[:100]}")
        op, name, target = item.get("op"), item.get("name"), item.get("target")
        if not _name(name) or name in nodes:
            raise SavedProgramError(f"{where}: its graph has a node named {str(name)[:100]!r} (node names are "
                                    f"distinct identifiers)")
        args, kwargs = item.get("args", []), item.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict) or not all(map(_name, kwargs)):
            raise SavedProgramError(f"{where}: node {name} has malformed arguments")
        args = _decode(args, nodes, f"{where}: node {name}", items)
        kwargs = {key: _decode(value, nodes, f"{where}: node {name}", items) for key, value in kwargs.items()}
        if op == "placeholder" and not args and not kwargs:
            node = graph.placeholder(name)
        elif op == "output" and len(args) == 1 and not kwargs:
            node = graph.output(args[0])
        elif op == "call_function":
            function = _resolve(target)
            if function is None:
                raise SavedProgramError(f"{where}: its graph calls {str(target)[:100]!r} (node {name}), which is not "
                                        f"on the positive list of what a saved program may call "
                                        f"(qgraph/saved/allowed.py)")
            node = graph.create_node("call_function", function, tuple(args), kwargs, name=name)
        elif op == "get_attr" and not args and not kwargs:
            if not held_name(target):
                raise SavedProgramError(f"{where}: node {name} reads {str(target)[:100]!r} (a held tensor's name is a "
                                        f"flat identifier, not starting with _)")
            if target not in tensors:
                raise SavedProgramError(f"{where}: node {name} reads {target}, a tensor the file does not hold")
            attributes[target] = tensors[target]
            node = graph.get_attr(target)
        else:
            raise SavedProgramError(f"{where}: its graph has a node {name} of kind {str(op)[:40]!r} (a saved program "
                                    f"holds placeholders, op calls, held tensors and one output)")
        nodes[name] = node
    if not graph.find_nodes(op="output"):
        raise SavedProgramError(f"{where}: its graph has no output")
    return graph, attributes


def _name(name: object) -> TypeGuard[str]:
    """An identifier fx may write into the code it generates (not a keyword, not ``self``)."""
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name) and name != "self" \
        and len(name) <= 256 and name.isascii()


def _decode(value, nodes: dict[str, Node], where: str, items: list[int], depth: int = 0):
    """``value`` read (node references to ``nodes``); ``items[0]`` counts the graph's argument items so far."""
    if depth > LIMITS["depth"]:
        raise SavedProgramError(f"{where} holds arguments nested deeper than {LIMITS['depth']}")
    items[0] += 1
    if items[0] > LIMITS["items"]:
        raise SavedProgramError(f"{where} takes its graph past {LIMITS['items']:,} argument items (each argument, "
                                f"list item and node reference counts): {budget.WHY}")
    if value is None or isinstance(value, (bool, float)):
        return value
    if isinstance(value, int):
        if not -LIMITS["int"] <= value < LIMITS["int"]:
            raise SavedProgramError(f"{where} holds the integer {str(value)[:40]}, past what a saved program holds")
        return value
    if isinstance(value, str):
        if len(value) > LIMITS["string"]:
            raise SavedProgramError(f"{where} holds a string of {len(value):,} characters (at most {LIMITS['string']})")
        return value
    if isinstance(value, list):
        if len(value) > LIMITS["list"]:
            raise SavedProgramError(f"{where} holds a list of {len(value):,} items (at most {LIMITS['list']:,})")
        return [_decode(item, nodes, where, items, depth + 1) for item in value]
    if isinstance(value, dict) and len(value) == 1:
        (tag, inner), = value.items()
        if tag == "node" and isinstance(inner, str) and inner in nodes:
            return nodes[inner]
        if tag == "tuple" and isinstance(inner, list):
            return tuple(_decode(inner, nodes, where, items, depth))
        if tag == "device" and isinstance(inner, str):
            return device(inner, where)
        if tag in _KINDS and _name(inner) and isinstance(getattr(torch, inner, None), _KINDS[tag]):
            return getattr(torch, inner)
        if tag == "slice" and isinstance(inner, list) and len(inner) == 3:
            return slice(*(_decode(part, nodes, where, items, depth + 1) for part in inner))
        if tag == "ellipsis" and inner is None:
            return Ellipsis
    raise SavedProgramError(f"{where} holds an argument it cannot read: {str(value)[:100]}")


def device(text: str, where: str) -> torch.device:
    """The device ``text`` names, if this machine has it (the CPU, or a CUDA device it has)."""
    try:
        found = torch.device(text)
    except (RuntimeError, TypeError):
        raise SavedProgramError(f"{where} names the device {text[:40]!r}, which is no device") from None
    if found.type == "cpu" and found.index in (None, 0):
        return found
    if found.type == "cuda" and torch.cuda.is_available() and (found.index or 0) < torch.cuda.device_count():
        return found
    cudas = f" and {torch.cuda.device_count()} cuda devices" if torch.cuda.is_available() else ""
    raise SavedProgramError(f"{where} names the device {text[:40]!r}, which this machine does not have (it has the "
                            f"cpu{cudas}): load it on a machine that has it, or save the program from a model on the "
                            f"cpu")
