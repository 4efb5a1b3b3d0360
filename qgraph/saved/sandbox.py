"""What an untrusted graph (a saved program's) must pass before anything of it runs.

``saved.fxdata`` builds the graph only from the positive list (``saved.allowed``) and identifiers; this
module checks what the graph does with them, at load:

- **Pure ops stay pure.** An op that takes a random generator when told to (``dropout``, ``sdpa``'s dropout)
  holds the one argument that makes it pure (``allowed.CONSTANT``).
- **Nothing outside the graph is written, or handed out** (``saved.aliasing``): an in-place op may write
  only a tensor the graph made; only a result of ``allowed.FRESH``'s ops is taken to be new storage, any
  other to alias every tensor it was given. No output is a weight, a held tensor or a view of one.
- **Every tensor it can make is bounded.** The graph runs once on fake tensors (shapes, no data), every
  size of the call's inputs a symbol: every node's arguments must fit its op (a malformed node is refused
  here, by name, not at the call), and each tensor's size in bytes is an expression of those symbols. Each
  must be a polynomial of degree at most ``DEGREE`` in them (at most 2 in any one: an attention pattern's
  batch × length²) and fit this machine's memory at the smallest call; each call then evaluates them on
  its own sizes (``Bounds.check``) before it runs.
Every refusal is a ``SavedProgramError`` naming the node and why.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Hashable, Mapping

import sympy
import torch
from torch.fx import GraphModule, Node

from .. import compat
from ..errors import InvalidArgument, SavedProgramError
from . import aliasing, budget
from .allowed import CHOICES, CONSTANT
from .fxdata import OP_OVERLOAD, device
from .work import evaluate, graph_work

DEGREE = 3  # batch × length², the attention pattern's size
WORK_PER_WEIGHT = 64  # operations a saved program may do per weight per token (a forward does about 2 to 3)
_METADATA = torch.ops.aten._assert_tensor_metadata.default


def check(module: GraphModule, placeholders: list[dict], symbols: dict, weights: list[bool],
          where: str) -> Bounds:
    """Check ``module``'s graph, its inputs shaped as ``placeholders`` say (``{"shape": [a size, or the
    name of a symbol of ``symbols``: ``{"min", "max"}``], "dtype", "device"}``), ``weights[i]`` telling
    whether input i is a weight (else the call's own); returns the bounds each call checks."""
    graph = module.graph
    for node in graph.nodes:
        _constant_arguments(node, where)
    aliasing.check(graph, {node for node, weight in zip(graph.find_nodes(op="placeholder"), weights) if not weight},
                   where)
    with compat.tracing():  # its fake run: one trace at a time in the process (compat.tracing)
        return _sizes(module, placeholders, symbols, where)


def _constant_arguments(node: Node, where: str) -> None:
    if node.op != "call_function" or not isinstance(node.target, OP_OVERLOAD):
        return
    for name, given, value in _arguments(node, CONSTANT.get(str(node.target), {})):
        if given != value or isinstance(given, Node):
            raise SavedProgramError(f"{where}: node {node.name} calls {node.target} with {name}={given!r}; a saved "
                                    f"program holds it only with {name}={value!r} (otherwise it draws random numbers)")
    refusal = outside_choices(node)
    if refusal:
        raise SavedProgramError(f"{where}: node {node.name} {refusal}")


def outside_choices(node: Node) -> str | None:
    """What is wrong with a call whose argument is not one of the values ``allowed.CHOICES`` lets it hold
    (None if nothing): the loader refuses the node, the writer the program."""
    if node.op != "call_function" or not isinstance(node.target, OP_OVERLOAD):
        return None
    for name, given, choices in _arguments(node, CHOICES.get(str(node.target), {})):
        if isinstance(given, Node) or given not in choices:
            return (f"calls {node.target} with {name}={given!r}; a saved program holds it only with {name} one of "
                    f"{', '.join(map(repr, choices))} (qgraph.saved.allowed.CHOICES says why)")
    return None


def _arguments(node: Node, positions: Mapping[int, object]):
    """(name, the value given or the default, what ``positions`` holds for it) of each argument at ``positions``."""
    schema = compat.op_schema(node.target)
    for index, value in positions.items():
        name = schema.arguments[index].name
        given = node.args[index] if index < len(node.args) else \
            node.kwargs.get(name, schema.arguments[index].default_value)
        yield name, given, value


# -- sizes -------------------------------------------------------------------------------------------


def memory_limit(device: torch.device) -> int:
    """The bytes a tensor on ``device`` can have at most: the machine's memory (the GPU's for cuda)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _sizes(module: GraphModule, placeholders: list[dict], limits: dict, where: str) -> Bounds:
    mode = compat.fake_mode()
    nodes = module.graph.find_nodes(op="placeholder")
    hints: dict[str, int] = {}  # a symbol -> the sandbox's size for it
    dims: dict[str, tuple[int, int]] = {}  # a symbol -> (input, dim) of its first use
    fakes: list[torch.Tensor] = []
    for index, (node, spec) in enumerate(zip(nodes, placeholders)):
        shape = []
        for dim, size in enumerate(spec["shape"]):
            if isinstance(size, str):
                if size not in hints:
                    hints[size] = _hint(limits[size]["min"], limits[size]["max"], len(hints))
                dims.setdefault(size, (index, dim))
                shape.append(hints[size])
            else:
                shape.append(size)
        dtype = getattr(torch, spec["dtype"].removeprefix("torch."))
        on = device(spec["device"], f"{where}: input {node.name}")
        if not any(isinstance(s, str) for s in spec["shape"]):
            with mode:  # a fake of its own: nothing allocated, however large
                fakes.append(torch.empty(shape, dtype=dtype, device=on))
            continue
        if math.prod(shape) > 2**24:  # a call's inputs (ids, a mask, positions): small at the sandbox's sizes
            raise SavedProgramError(f"{where}: its input {node.name} is {shape} at the sandbox's sizes, more than "
                                    f"any input a saved program takes")
        # the symbols' dims symbolic, the sizes given as ints fixed (a function edit's [batch seq hidden_size])
        fakes.append(compat.fake(mode, torch.empty(shape, dtype=dtype, device=on),
                                 dynamic=[isinstance(size, str) for size in spec["shape"]]))
    made = _propagate(module, mode, fakes, where)
    # symbol -> (input, dim, {"min", "max"}), read after the run: what it found equal (the mask's sizes and the
    # ids') is one symbol
    symbols: dict[sympy.Expr, tuple[int, int, dict]] = {}
    for size, (index, dim) in dims.items():
        value = fakes[index].shape[dim]
        if isinstance(value, torch.SymInt):
            expression, high = compat.size_expression(value), limits[size]["max"]
            if not expression.free_symbols and (high is None or int(expression) < high):
                # a guard of the graph's (or of an op's on this torch) fixed it to the example: bounds of
                # that one call would be no bounds of the others
                raise SavedProgramError(f"{where}: its graph fixes the call's size {size!r} to {expression}, the "
                                        f"sandbox's example, so what it makes cannot be bounded for every call: a "
                                        f"saved program's sizes stay symbolic")
            symbols[expression] = (index, dim, limits[size])
    work = graph_work(made)
    found: dict = {}  # bytes expression -> (node, device)
    counted: set[int] = set()  # ids of the fake results already counted (a reused one: its first node's)
    for node, value in made:
        for tensor in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(tensor, torch.Tensor) and id(tensor) not in counted:
                counted.add(id(tensor))
                size = sympy.sympify(compat.size_expression(tensor.numel())) * tensor.element_size()
                found.setdefault(size, (node, tensor.device))
    return Bounds(found, symbols, where, work)


def _hint(low: int, high: int | None, taken: int) -> int:
    """The example size the fake run gives the ``taken``-th symbol of ``[low, high]``: distinct ones (equal
    ones would be taken for one size), above 1 where the range allows (torch fixes 0 and 1)."""
    hint = max(low, 2) + 61 + 2 * taken
    return hint if high is None else min(hint, high)


def _propagate(module: GraphModule, mode, fakes: list, where: str) -> list:
    """``[(node, fake value)]`` of every node of ``module`` run on ``fakes`` (held tensors faked too), each
    node held to the load's budget as it runs (``budget.Meter``)."""
    made, meter = [], budget.Meter(where, mode)
    seen: dict[Hashable, object] = {}  # a kind of op call (_kind) -> its fake result
    kinds: dict[int, tuple[torch.Tensor, tuple]] = {}  # id of a tensor -> (it, its kind): _kind's

    class Fake(torch.fx.Interpreter):
        def get_attr(self, target, args, kwargs):
            return compat.fake(mode, super().get_attr(target, args, kwargs), dynamic=False)

        def call_function(self, target, args, kwargs):
            # one op on arguments of one kind (shapes, strides, dtypes, literals) makes one kind of result:
            # the blocks of a model repeat their ops, so each kind runs once (a fake result holds no data)
            key = _kind((target, _shaping(target, args), kwargs), kinds)
            if key is not None and key in seen:
                return seen[key]
            meter.call(self.node, target, args, kwargs)
            value = compat.fake_call(target, args, kwargs)
            if key is not None:
                seen[key] = value
            return value

        def run_node(self, node):
            if node.target is _METADATA:  # a check of its argument's dtype and device: nothing it makes
                return None
            self.node = node
            try:
                value = super().run_node(node)
            except SavedProgramError:
                raise
            except Exception as error:  # noqa: BLE001 (any failure of a node is the file's)
                message = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
                raise SavedProgramError(f"{where}: node {node.name} ({node.target}) does not fit its arguments: "
                                        f"{message}") from None
            meter.made(node, value)
            made.append((node, value))
            return value

    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # the refusal says it: no log of torch's too
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    interpreter = Fake(module)
    interpreter.extra_traceback = False  # the refusal names the node; no listing of it (its arguments) too
    try:
        with mode:
            interpreter.run(*fakes)
    finally:
        quiet.setLevel(level)
    return made


def _shaping(target, args: tuple) -> tuple:
    """``args`` without what cannot change the shape of ``target``'s result: an edit slot's name (its
    result is its input's like, whatever slot it is), so the slots of every block are one kind."""
    return args[:1] if isinstance(target, OP_OVERLOAD) and str(target) == "qgraph.edit_slot.default" else args


def _kind(value, tensors: dict):
    """A hashable description of an op call's arguments as a fake run sees them (None if there is none);
    ``tensors`` keeps each tensor's, by id (with the tensor, so the id stays its own)."""
    if isinstance(value, torch.Tensor):
        if id(value) not in tensors:
            tensors[id(value)] = value, (
                "tensor", tuple(map(compat.size_expression, value.shape)),
                tuple(map(compat.size_expression, value.stride())), compat.size_expression(value.storage_offset()),
                value.dtype, value.device, value.requires_grad)
        return tensors[id(value)][1]
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("symbol", type(value).__name__, value.node.expr)
    if isinstance(value, (list, tuple)):
        items = tuple(_kind(item, tensors) for item in value)
        return None if any(item is None for item in items) else (type(value).__name__, items)
    if isinstance(value, dict):
        items = tuple((key, _kind(item, tensors)) for key, item in value.items())
        return None if any(item is None for _, item in items) else ("dict", items)
    if isinstance(value, slice):
        return _kind(("slice", value.start, value.stop, value.step), tensors)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)) or callable(value) or value is Ellipsis:
        return ("literal", type(value).__name__, value)
    return None


class Bounds:
    """The size in bytes of every tensor a graph can make, as expressions of its inputs' sizes; checked at
    load (the degree, and the smallest call) and by each call on its own sizes."""

    def __init__(self, found: dict, symbols: dict, where: str, work=0):
        self.symbols = symbols  # symbol -> (placeholder index, dim, {"min", "max"})
        self.sizes = found
        self.work = work  # floating-point operations of one call (saved.work), an expression of the symbols
        self.max_work: float | None = None  # a call over it is refused (qgraph.load(..., max_work=))
        self._seen: set = set()
        if set(getattr(work, "free_symbols", ())) - set(symbols):
            raise SavedProgramError(f"{where}: its work depends on its data ({work} operations), which a saved "
                                    f"program cannot bound")
        _upper(work, None, where)  # a polynomial of the sizes, or refused
        low = {symbol: max(1, int(limits["min"])) for symbol, (_, _, limits) in symbols.items()}
        for size, (node, on) in found.items():
            unknown = size.free_symbols - set(symbols)
            if unknown:
                raise SavedProgramError(f"{where}: node {node.name} makes a tensor whose size depends on its data "
                                        f"({size} bytes), which a saved program cannot bound")
            _degree(size, list(symbols), node, where)
            least = int(size.xreplace(low))
            if least > memory_limit(on):
                raise SavedProgramError(f"{where}: node {node.name} makes a tensor of {least:,} bytes at the smallest "
                                        f"call, more than this machine's memory")

    def check_work_per_weight(self, elements: int, where: str) -> None:
        """Refuse a program that computes more than a model of its ``elements`` weights could: per row and
        token (every term linear in each size, the constant too) ``WORK_PER_WEIGHT`` operations per weight,
        and per pair of tokens (a size squared: attention) that many per square root of the weights (an
        attention head's reads per pair of tokens grow as the hidden size, the weights as its square)."""
        bound = sympy.Poly(sympy.expand(_upper(self.work, None, where)), *self.symbols) if self.symbols \
            else sympy.Poly(sympy.expand(self.work), sympy.Symbol("unused"))
        for powers, coefficient in bound.terms():
            square = any(power > 1 for power in powers)
            most = WORK_PER_WEIGHT * (math.isqrt(elements) + 1 if square else max(elements, 1))
            if coefficient > most:
                term = sympy.Mul(*(symbol ** power for symbol, power in zip(self.symbols, powers)))
                raise SavedProgramError(
                    f"{where}: its graph computes {float(coefficient):.3g} operations per {term} (a row, a token"
                    f"{', a pair of tokens' if square else ''}), more than {most:.3g}, the most a model of its "
                    f"{elements:,} weights does ({WORK_PER_WEIGHT} per weight{'s square root' if square else ''}): "
                    f"it is not a program ig.save writes")

    def work_at(self, shapes: list) -> float:
        """The floating-point operations of a call whose inputs have ``shapes`` (one per input)."""
        return evaluate(self.work, self._values(shapes))

    def _values(self, shapes: list) -> dict:
        values = {}  # the call's size for each symbol: all the sizes depend on (the weights' are fixed)
        for symbol, (index, dim, limits) in self.symbols.items():
            value = shapes[index][dim]
            if limits["max"] is not None and value > limits["max"]:
                raise InvalidArgument(f"this program takes at most {limits['max']} along dim {dim} of its input "
                                      f"{index}; the call has {value}")
            values[symbol] = value
        return values

    def check(self, args: list) -> None:
        """Refuse a call (its arguments ``args``) whose sizes are out of the graph's range, for which the
        graph would make a tensor larger than the memory of its device, or do more work than ``max_work``."""
        values = self._values([getattr(arg, "shape", ()) for arg in args])
        key = tuple(values.values())
        if key in self._seen:
            return
        if self.max_work is not None and evaluate(self.work, values) > self.max_work:
            raise InvalidArgument(f"this call would compute {evaluate(self.work, values):.3g} floating-point "
                                  f"operations, more than max_work={self.max_work:.3g} given to qgraph.load: call "
                                  f"with fewer or shorter prompts, or load with a larger max_work")
        for size, (node, on) in self.sizes.items():
            needed = int(size.xreplace(values)) if size.free_symbols else int(size)
            if needed > memory_limit(on):
                raise InvalidArgument(f"this call would make a tensor of {needed / 2**30:,.1f} GiB (node {node.name}), "
                                      f"more than the memory of {on}: call with fewer or shorter prompts")
        self._seen.add(key)


def _degree(size, symbols: list, node: Node, where: str) -> None:
    """Refuse a size that grows faster than ``DEGREE`` in the call's sizes (or 2 in any one of them)."""
    bound = _upper(size, node, where)
    if not symbols or not bound.free_symbols:
        return
    poly = sympy.Poly(sympy.expand(bound), *symbols)
    worst = max(poly.degree(symbol) for symbol in symbols)
    if poly.total_degree() > DEGREE or worst > 2:
        raise SavedProgramError(f"{where}: node {node.name} makes a tensor of {size} bytes, which grows faster with "
                                f"the call's sizes than any tensor a saved program makes (at most batch × length²)")


def _upper(expr, node: Node | None, where: str):
    """A polynomial at least ``expr`` for sizes of at least 1: a floor division by its dividend, a remainder
    by its divisor, a max or min by the sum of its arguments."""
    if isinstance(expr, (sympy.Symbol, sympy.Integer, sympy.Rational)):
        return expr
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        return expr.func(*(_upper(arg, node, where) for arg in expr.args))
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and expr.exp >= 0:
        return sympy.Pow(_upper(expr.base, node, where), expr.exp)
    name = type(expr).__name__
    if name in ("FloorDiv", "CleanDiv", "IntTrueDiv"):
        return _upper(expr.args[0], node, where)
    if name in ("Mod", "PythonMod"):
        return _upper(expr.args[1], node, where)
    if name in ("Max", "Min"):
        return sympy.Add(*(_upper(arg, node, where) for arg in expr.args))
    if name in ("CeilDiv", "CeilToInt", "FloorToInt", "TruncToInt"):
        return _upper(expr.args[0], node, where) + 1
    what = f"node {node.name} makes a tensor of {expr} bytes" if node is not None else f"its work is {expr} operations"
    raise SavedProgramError(f"{where}: {what}, which a saved program cannot bound ({name})")
