"""An exported program as JSON data, and back: what the disk cache holds (``export.disk_cache``).

``torch.export.save`` / ``load`` take a program through a schema of dataclasses and parse each size of each
node's value from a string with sympy: 2 s of a fresh process for the tiny model's seed, most of what the
first call waited for. Here a node is a list ``[name, op, target, args, kwargs, meta]``; a size is an int,
a symbol's name, or ``[function, *arguments]`` over them (``Add``, ``Mul``, ``Pow``, torch's ``FloorDiv``...),
so reading one builds the expression without parsing; a node's value (``meta["val"]``: a fake tensor, a
symbolic int, or a tuple of them) is made again over a fresh shape environment holding the program's
symbols with their example values and ranges, one symbolic int per distinct size (``compat.torch_stored``).

Arguments are the fx graph's own: node references ``{"n": name}``, tuples ``{"t": [...]}``, dtypes, devices,
layouts and memory formats as ``{"dtype": "float32"}`` and alike, non-finite floats ``{"f": "inf"}``; other
values are themselves. A ``call_function`` target is an op of torch's registry (``torch.ops.aten.mul.Tensor``,
looked up, never imported) or one of the size functions export writes (``export.sizes``). What the writer
cannot write (a held submodule, an argument of another type) raises ``NotSupported``, and the program is
then not cached (it is exported again next time). The file is qgraph's own, in the user's cache directory.
"""
from __future__ import annotations

import math
from typing import Any

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry
from torch.export.graph_signature import (ConstantArgument, ExportGraphSignature, InputKind, InputSpec,
                                          OutputKind, OutputSpec, SymIntArgument, TensorArgument)
from torch.fx import Graph, Node

from .. import compat
from ..compat.torch_stored import (example_of, size_functions, stored_fake_mode, sym_int, symbol_range,
                                   training_verifier, value_range)
from ..errors import NotSupported, SavedProgramError
from .sizes import SIZE_FUNCTIONS

FORMAT = 1
_OP = type(torch.ops.aten.add.Tensor)
_FUNCTION_NAMES = {id(function): name for name, function in SIZE_FUNCTIONS.items()}
_KINDS = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}
_ARGUMENTS = {"tensor": TensorArgument, "symint": SymIntArgument}
_META = ("stack_trace", "torch_fn")  # kept as they are (strings); nn_module_stack and val are encoded


# -- writing ---------------------------------------------------------------------------------------------


def program_data(program: ExportedProgram) -> tuple[dict, dict[str, torch.Tensor]]:
    """``program`` as JSON data, and the constant tensors it holds (by name) to store beside it; its
    parameters and buffers are stored as shapes and dtypes (the program reads the model's own)."""
    symbols = {str(symbol): [example_of(program, symbol), *symbol_range(program, symbol)]
               for symbol in program.range_constraints}
    nodes = [_node(node, symbols, program) for node in program.graph.nodes]
    signature = program.graph_signature
    weights = {name: [list(tensor.shape), _name(tensor.dtype), str(tensor.device),
                      isinstance(tensor, torch.nn.Parameter)] for name, tensor in program.state_dict.items()}
    constants = {name: value for name, value in program.constants.items()}
    if any(not isinstance(value, torch.Tensor) for value in constants.values()):
        raise NotSupported("the program holds a constant that is not a tensor")
    data = {"format": FORMAT, "symbols": symbols, "nodes": nodes, "weights": weights,
            "inputs": [[spec.kind.name, *_argument(spec.arg), spec.target, spec.persistent]
                       for spec in signature.input_specs],
            "outputs": [[spec.kind.name, *_argument(spec.arg), spec.target] for spec in signature.output_specs],
            "calls": [entry.fqn for entry in program.module_call_graph]}
    return data, {name: tensor.detach().contiguous() for name, tensor in constants.items()}


def _node(node: Node, symbols: dict, program: ExportedProgram) -> list:
    if node.op == "call_function":
        target = f"torch.ops.{node.target}" if isinstance(node.target, _OP) else _FUNCTION_NAMES.get(id(node.target))
        if target is None:
            raise NotSupported(f"node {node.name} calls {node.target!r}, which the cache cannot name")
    elif node.op in ("placeholder", "output"):
        target = node.target if node.op == "placeholder" else None
    else:
        raise NotSupported(f"node {node.name} is a {node.op}: the cache holds calls of ops only")
    meta: dict[str, Any] = {key: node.meta[key] for key in _META if node.meta.get(key) is not None}
    if "nn_module_stack" in node.meta:
        meta["nn_module_stack"] = {key: [path, _class_name(kind)]
                                   for key, (path, kind) in node.meta["nn_module_stack"].items()}
    if "val" in node.meta:
        meta["val"] = _value(node.meta["val"], symbols, node)
    if node.meta.get("unbacked_bindings"):
        raise NotSupported(f"node {node.name} binds a data-dependent size")
    return [node.name, node.op, target, _encode(list(node.args), node), _encode(dict(node.kwargs), node), meta]


def _encode(value, node: Node):
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": str(value)}
    if isinstance(value, Node):
        return {"n": value.name}
    if isinstance(value, list):
        return [_encode(item, node) for item in value]
    if isinstance(value, tuple):
        return {"t": [_encode(item, node) for item in value]}
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {"d": {key: _encode(item, node) for key, item in value.items()}}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    for kind, cls in _KINDS.items():
        if isinstance(value, cls):
            return {kind: _name(value)}
    raise NotSupported(f"node {node.name} takes a {type(value).__name__}, which the cache cannot hold")


def _value(value, symbols: dict, node: Node):
    """A node's fake value as data: ``{"tensor": [sizes, strides, dtype, device, requires_grad]}``,
    ``{"int": size}``, a list of values, or a plain number / None."""
    if isinstance(value, torch.Tensor):
        return {"tensor": [[_size(s, symbols, node) for s in value.shape], [_size(s, symbols, node)
                           for s in value.stride()], _name(value.dtype), str(value.device), value.requires_grad]}
    if isinstance(value, torch.SymInt):
        return {"int": _size(value, symbols, node)}
    if isinstance(value, (list, tuple)):
        return [_value(item, symbols, node) for item in value]
    if value is None or isinstance(value, (bool, int)) or isinstance(value, float) and math.isfinite(value):
        return value
    raise NotSupported(f"node {node.name}'s value is a {type(value).__name__}, which the cache cannot hold")


def _size(size, symbols: dict, node: Node):
    return _expression(compat.size_expression(size), symbols, node)


def _expression(expression, symbols: dict, node: Node):
    if isinstance(expression, int) or expression.is_Integer:
        return int(expression)
    if expression.is_Symbol:
        if expression.name not in symbols:
            raise NotSupported(f"node {node.name}'s value has the size {expression}, which is not a symbol of the "
                               f"program's")
        return expression.name
    name = type(expression).__name__
    if name not in size_functions():
        raise NotSupported(f"node {node.name}'s value has a size of {name}, which the cache cannot hold")
    return [name, *(_expression(argument, symbols, node) for argument in expression.args)]


def _argument(argument) -> list:
    if isinstance(argument, ConstantArgument):
        if not (argument.value is None or isinstance(argument.value, (bool, int, float, str))):
            raise NotSupported(f"the program's signature holds a {type(argument.value).__name__}")
        return ["constant", argument.name, argument.value]
    kind = next((kind for kind, cls in _ARGUMENTS.items() if type(argument) is cls), None)
    if kind is None:
        raise NotSupported(f"the program's signature holds a {type(argument).__name__}")
    return [kind, argument.name, None]


def _class_name(kind) -> str:
    return kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"


def _name(value) -> str:
    return str(value).removeprefix("torch.")


# -- reading ---------------------------------------------------------------------------------------------


def program_from_data(data: dict, constants: dict[str, torch.Tensor]) -> ExportedProgram:
    """The program ``program_data`` wrote (with the constants stored beside it)."""
    if data.get("format") != FORMAT:
        raise SavedProgramError(f"a cached program of format {data.get('format')!r}, not {FORMAT}: "
                                "it is exported again")
    mode, symbols = stored_fake_mode({name: tuple(entry) for name, entry in data["symbols"].items()})
    reader = _Reader(mode, symbols, {name: entry[0] for name, entry in data["symbols"].items()})
    graph = Graph()
    nodes: dict[str, Node] = {}
    for name, op, target, args, kwargs, meta in data["nodes"]:
        if op == "placeholder":
            node = graph.placeholder(target)
        elif op == "output":
            node = graph.output(_decode(args, nodes)[0])
        else:
            node = graph.call_function(_target(target), tuple(_decode(args, nodes)), _decode(kwargs, nodes))
        node.name = name  # the signature and the passes name nodes as export did
        node.meta.update({key: meta[key] for key in _META if key in meta})
        if "torch_fn" in node.meta:
            node.meta["torch_fn"] = tuple(node.meta["torch_fn"])
        if "nn_module_stack" in meta:
            node.meta["nn_module_stack"] = {key: tuple(entry) for key, entry in meta["nn_module_stack"].items()}
        if "val" in meta:
            node.meta["val"] = reader.value(meta["val"])
        nodes[name] = node
    state_dict = {name: _placeholder(*entry) for name, entry in data["weights"].items()}
    signature = ExportGraphSignature([InputSpec(InputKind[kind], _read_argument(*argument), target, persistent)
                                      for kind, *argument, target, persistent in data["inputs"]],
                                     [OutputSpec(OutputKind[kind], _read_argument(*argument), target)
                                      for kind, *argument, target in data["outputs"]])
    ranges = {symbols[name]: value_range(low, high) for name, (_, low, high) in data["symbols"].items()}
    calls = [ModuleCallEntry(fqn, None) for fqn in data["calls"]]
    root = compat.lazy_graph_module(torch.nn.Module(), graph)
    return compat.exported_program(root, graph, signature, state_dict, ranges, calls, dict(constants),
                                   training_verifier())


class _Reader:
    """Makes node values again: one symbolic int per distinct size, one fake tensor per distinct description
    (a fake value holds no data, and the blocks repeat: 101 kinds make the tiny seed's 380 values; each
    fake tensor over symbolic sizes costs about a millisecond to make)."""

    def __init__(self, mode, symbols: dict[str, sympy.Symbol], examples: dict[str, int | None]):
        self.mode, self.symbols, self.functions = mode, symbols, size_functions()
        self.examples = {symbols[name]: sympy.Integer(example) for name, example in examples.items()
                         if example is not None}
        self.sizes: dict[str, Any] = {}
        self.tensors: dict[str, torch.Tensor] = {}

    def value(self, data):
        if isinstance(data, dict) and "tensor" in data:
            key = str(data["tensor"])
            if key not in self.tensors:
                sizes, strides, dtype, device, grad = data["tensor"]
                with self.mode:
                    self.tensors[key] = torch.empty_strided(
                        [self.size(s) for s in sizes], [self.size(s) for s in strides], dtype=getattr(torch, dtype),
                        device=device, requires_grad=grad)
            return self.tensors[key]
        if isinstance(data, dict) and "int" in data:
            return self.size(data["int"])
        if isinstance(data, list):
            return [self.value(item) for item in data]
        return data

    def size(self, data):
        if isinstance(data, int):
            return data
        key = str(data)
        if key not in self.sizes:
            expression = self.expression(data)
            example = expression.xreplace(self.examples)
            self.sizes[key] = sym_int(self.mode, expression, int(example) if example.is_Integer else None)
        return self.sizes[key]

    def expression(self, data) -> sympy.Expr:
        if isinstance(data, int):
            return sympy.Integer(data)
        if isinstance(data, str):
            return self.symbols[data]
        return self.functions[data[0]](*(self.expression(argument) for argument in data[1:]))


def _decode(value, nodes: dict[str, Node]):
    if isinstance(value, list):
        return [_decode(item, nodes) for item in value]
    if not isinstance(value, dict):
        return value
    (kind, item), = value.items()
    if kind == "n":
        return nodes[item]
    if kind == "t":
        return tuple(_decode(part, nodes) for part in item)
    if kind == "d":
        return {key: _decode(part, nodes) for key, part in item.items()}
    if kind == "f":
        return float(item)
    if kind == "device":
        return torch.device(item)
    return getattr(torch, item)  # a dtype, layout or memory format, by its name in torch


def _target(name: str):
    if name in SIZE_FUNCTIONS:
        return SIZE_FUNCTIONS[name]
    namespace, op, overload = name.removeprefix("torch.ops.").split(".")
    found = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    if not isinstance(found, _OP):
        raise SavedProgramError(f"{name} in a cached program is not an op: the file is exported again")
    return found


def _read_argument(kind: str, name: str, value):
    return ConstantArgument(name, value) if kind == "constant" else _ARGUMENTS[kind](name=name)


def _placeholder(shape: list[int], dtype: str, device: str, parameter: bool) -> torch.Tensor:
    """A weight's stand-in: one element of its dtype, expanded to its shape (the program reads the model's)."""
    tensor = torch.zeros((), dtype=getattr(torch, dtype), device=device).expand(shape)
    return torch.nn.Parameter(tensor, requires_grad=False) if parameter else tensor

