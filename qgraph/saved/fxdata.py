"""An fx graph as JSON data, and back: what a saved program's ``graph.json`` holds.

``graph_data(module, tensors)`` writes each node of ``module.graph`` as ``{"name", "op", "target",
"args", "kwargs"}``; node references, tuples, dtypes, devices, layouts, memory formats, slices and
``...`` are tagged one-key objects (``{"node": "linear_3"}``, ``{"tuple": [...]}``, ``{"dtype":
"float32"}``), numbers, strings, booleans, None and lists are themselves. The tensors ``get_attr``
nodes read go to ``tensors`` (the file's safetensors); a graph module one reads (a higher-order op's
body) is saved as a graph of its own under ``modules``. Node meta is not saved: nothing runs on it.

A target is saved by name and read back from an allow-list, never imported: an op of the ``aten``,
``prims`` or ``qgraph`` namespaces (``torch.ops.aten.linear.default``, looked up in torch's op
registry) but those in ``DENIED`` (``aten.from_file`` opens a file the graph names), the higher-order
ops of ``HIGHER_ORDER``, and the arithmetic of ``FUNCTIONS`` that export uses on sizes
(``operator.getitem``, ``torch.sym_max``, ...). Names, placeholders, keywords and attribute paths
must be identifiers (fx writes them into the code it generates); anything else refuses the file by
name (``SavedProgramError``). So ``graph_from_data`` builds nodes and nothing in the file runs: the
code fx generates for the graph calls allow-listed operations on identifiers and literals.
"""
from __future__ import annotations

import keyword
import math
import operator

import torch
from torch.fx import Graph, GraphModule, Node

from ..errors import NotSupported, SavedProgramError

NAMESPACES = ("aten", "prims", "qgraph")
HIGHER_ORDER = ("wrap_with_set_grad_enabled", "wrap_with_autocast")
FUNCTIONS = {
    **{f"operator.{name}": getattr(operator, name) for name in (
        "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "eq", "ne", "lt",
        "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift", "rshift")},
    **{f"math.{name}": getattr(math, name) for name in ("floor", "ceil", "trunc", "sqrt")},
    **{f"torch.{name}": getattr(torch, name) for name in (
        "sym_float", "sym_int", "sym_max", "sym_min", "sym_not", "sym_sqrt", "sym_ite", "sym_sum")},
}
DENIED = ("torch.ops.aten.from_file.default",)  # maps a file named by the graph (writable with shared=True)
_BY_ID = {id(function): name for name, function in FUNCTIONS.items()}
_OP_OVERLOAD = type(torch.ops.aten.add.Tensor)  # the class of every registered op's overload
_OP_PACKET = type(torch.ops.aten.add)  # and of its overloads together
_KINDS = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}


# -- writing ---------------------------------------------------------------------------------------


def target_name(target) -> str:
    """The allow-listed name of a ``call_function`` target (``NotSupported`` for any other)."""
    if isinstance(target, _OP_OVERLOAD):
        name = f"torch.ops.{target}"  # str(op) is "aten.linear.default"
    elif id(target) in _BY_ID:
        name = _BY_ID[id(target)]
    else:
        name = next((f"torch.ops.higher_order.{hop}" for hop in HIGHER_ORDER
                     if getattr(torch.ops.higher_order, hop, None) is target), None)
    if name is None or _resolve(name) is not target:
        raise NotSupported(f"the program calls {getattr(target, '__qualname__', target)!r}, which a saved program "
                           f"cannot name (it may call ops of {', '.join(NAMESPACES)} and size arithmetic)")
    return name


def graph_data(module: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str = "") -> dict:
    """``module.graph`` as JSON data (``module`` holds what it reads); the tensors its ``get_attr``
    nodes read go into ``tensors`` (under ``prefix`` and their attribute paths), the graph modules
    they read are saved under ``modules``."""
    nodes, modules = [], {}
    for node in module.graph.nodes:
        item = {"name": node.name, "op": node.op}
        if node.op == "call_function":
            item["target"] = target_name(node.target)
        elif node.op == "get_attr":
            item["target"] = node.target
            held = _attribute(module, node.target)
            if isinstance(held, GraphModule):
                modules[node.target] = graph_data(held, tensors, f"{prefix}{node.target}.")
            elif isinstance(held, torch.Tensor):
                tensors[prefix + node.target] = held
            else:
                raise NotSupported(f"the program's node {node.name} reads a {type(held).__name__}, which a saved "
                                   f"program cannot hold")
        elif node.op not in ("placeholder", "output"):
            raise NotSupported(f"the program's node {node.name} is a {node.op} of {node.target!r}: a saved program "
                               f"holds calls of ops only")
        if node.args:
            item["args"] = [_encode(arg, node) for arg in node.args]
        if node.kwargs:
            item["kwargs"] = {key: _encode(value, node) for key, value in node.kwargs.items()}
        nodes.append(item)
    return {"nodes": nodes, "modules": modules}


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


def _resolve(name: str):
    """The operation an allow-listed name stands for, or None. Ops are looked up in torch's registry
    (attribute lookups on ``torch.ops``); nothing is imported."""
    if name in FUNCTIONS:
        return FUNCTIONS[name]
    parts = name.split(".")
    if parts[:2] != ["torch", "ops"] or not all(map(_name, parts[2:])):
        return None
    if len(parts) == 4 and parts[2] == "higher_order" and parts[3] in HIGHER_ORDER:
        return getattr(torch.ops.higher_order, parts[3], None)
    if len(parts) != 5 or parts[2] not in NAMESPACES or parts[4].startswith("__") or name in DENIED:
        return None
    try:  # an op's name may be a dunder (aten.__and__); what it names must be an op's overloads
        packet = getattr(getattr(torch.ops, parts[2]), parts[3])
        op = getattr(packet, parts[4]) if isinstance(packet, _OP_PACKET) else None
    except (AttributeError, RuntimeError):
        return None
    return op if isinstance(op, _OP_OVERLOAD) else None


def graph_from_data(data: dict, tensors: dict[str, torch.Tensor], where: str, prefix: str = "") -> GraphModule:
    """The graph module of ``graph_data``'s ``data``, its ``get_attr`` nodes reading ``tensors`` (and
    the nested graphs); a name outside the allow-list refuses the file (``where`` names it)."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise SavedProgramError(f"{where}: its graph.json has no list of nodes")
    graph, nodes, attributes = Graph(), {}, {}
    modules = data.get("modules") or {}
    for item in data["nodes"]:
        if not isinstance(item, dict):
            raise SavedProgramError(f"{where}: a node of its graph is a {type(item).__name__}, not an object")
        op, name, target = item.get("op"), item.get("name"), item.get("target")
        if not _name(name) or name in nodes:
            raise SavedProgramError(f"{where}: its graph has a node named {name!r} (node names are distinct "
                                    f"identifiers)")
        args = _decode(item.get("args", []), nodes, where)
        kwargs = item.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict) or \
                not all(key.isidentifier() and not keyword.iskeyword(key) for key in kwargs):
            raise SavedProgramError(f"{where}: node {name} has malformed arguments")
        kwargs = {key: _decode(value, nodes, where) for key, value in kwargs.items()}
        if op == "placeholder":
            node = graph.placeholder(name)
        elif op == "output" and len(args) == 1:
            node = graph.output(args[0])
        elif op == "call_function":
            function = _resolve(target) if isinstance(target, str) else None
            if function is None:
                raise SavedProgramError(f"{where}: its graph calls {target!r} (node {name}), which is not an operation "
                                        f"a saved program may call (ops of {', '.join(NAMESPACES)}, the higher-order "
                                        f"ops {', '.join(HIGHER_ORDER)} and size arithmetic)")
            node = graph.create_node("call_function", function, tuple(args), kwargs, name=name)
        elif op == "get_attr":
            if not isinstance(target, str) or not all(map(_name, target.split("."))):
                raise SavedProgramError(f"{where}: node {name} reads {target!r} (attribute paths are dotted "
                                        f"identifiers)")
            if target in modules:
                attributes[target] = graph_from_data(modules[target], tensors, where, f"{prefix}{target}.")
            elif prefix + target in tensors:
                attributes[target] = tensors[prefix + target]
            else:
                raise SavedProgramError(f"{where}: node {name} reads {target}, a tensor the file does not hold")
            node = graph.get_attr(target)
        else:
            raise SavedProgramError(f"{where}: its graph has a node {name} of kind {op!r} (a saved program holds "
                                    f"placeholders, op calls, held tensors and one output)")
        nodes[name] = node
    return GraphModule(attributes, graph)


def _name(name) -> bool:
    """An identifier fx may write into the code it generates (not a keyword, not ``self``)."""
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name) and name != "self"


def _decode(value, nodes: dict[str, Node], where: str):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(item, nodes, where) for item in value]
    if isinstance(value, dict) and len(value) == 1:
        (tag, inner), = value.items()
        if tag == "node" and isinstance(inner, str) and inner in nodes:
            return nodes[inner]
        if tag == "tuple" and isinstance(inner, list):
            return tuple(_decode(item, nodes, where) for item in inner)
        if tag == "device" and isinstance(inner, str):
            try:
                return torch.device(inner)
            except RuntimeError:
                pass
        if tag in _KINDS and _name(inner) and isinstance(getattr(torch, inner, None), _KINDS[tag]):
            return getattr(torch, inner)
        if tag == "slice" and isinstance(inner, list) and len(inner) == 3:
            return slice(*(_decode(part, nodes, where) for part in inner))
        if tag == "ellipsis":
            return Ellipsis
    raise SavedProgramError(f"{where}: its graph holds an argument it cannot read: {str(value)[:100]}")
