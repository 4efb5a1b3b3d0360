"""The modules a built program calls (a slot's fixed edit, an SAE's or a transcoder's ``encode``,
``decode``, ...) as ops in its graph: what ``ig.save`` does before writing it, since a saved program
holds no Python.

Each ``call_module`` node's module is exported alone (``torch.export``) on zeros shaped like its
inputs, each dim that varies in the program (batch, length: a symbolic size there) dynamic, dims of
one size symbol one size. It is exported twice: first with the dims free (``Dim.DYNAMIC``), then with
each dim's range as the first export found it (a lower bound, such as an edit's position needs), so
a module whose code takes another path at some size is refused (a saved graph holds one path), not
saved wrong. Its graph replaces the node (one export serves every call of a module on inputs of one
shape), after an assertion of each size the module needs (``_needs``: a fixed edit at position 3
needs a length of 4), so a call the module would refuse (an ``EditError``) is refused, not edited
elsewhere. The tensors it reads (the SAE's weights, an edit's tensors) become tensors the program
holds (``get_attr`` nodes), each once however many calls read it.
"""
from __future__ import annotations

import operator
import warnings

import torch
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Graph, Node

from .. import compat
from ..errors import NotSupported


def inline_modules(module: torch.nn.Module, describe) -> None:
    """Replace every ``call_module`` node of ``module.graph`` by the graph of its module's call (the
    module holding what the graph reads: a graph module, or one that is not compiled); ``describe(
    module, target)`` says what the module is, for errors. Last call first: each call's inputs are
    then still the program's own nodes, with their symbolic shapes."""
    held: dict[int, str] = {}  # id of a tensor read -> the attribute holding it
    # (module, its inputs' shapes) -> what _export found: one export per kind of call
    traced: dict[tuple, tuple[ExportedProgram, bool, list[tuple]]] = {}
    graph: Graph = module.graph  # a graph module's, or the draft's that save writes (never compiled)
    calls = graph.find_nodes(op="call_module")
    for node in reversed(calls):
        called = _Call(module.get_submodule(node.target))
        key = (node.target, *(_shape_of(arg) for arg in node.args))
        try:
            if key not in traced:
                traced[key] = _export(called, node)
        except Exception as error:
            reason = str(error) if isinstance(error, NotSupported) else \
                f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
            raise NotSupported(f"{describe(called.called, node.target)} cannot be traced into the saved program "
                               f"({reason})") from error
        _splice(module, node, called, *traced[key], describe(called.called, node.target), held)
    for target in {node.target for node in calls}:
        drop_submodule(module, target)
    graph.lint()


def _shape_of(arg):
    """What a call's input is, for telling calls of one module apart: its fake value's shape and dtype."""
    value = arg.meta.get("val") if isinstance(arg, Node) else None
    return (str(value.shape), value.dtype) if isinstance(value, torch.Tensor) else id(arg)


class _Call(torch.nn.Module):
    """A module called with its inputs as one varargs tuple (so one form of ``dynamic_shapes`` fits all)."""

    def __init__(self, called: torch.nn.Module):
        super().__init__()
        self.called = called

    def forward(self, *inputs):
        return self.called(*inputs)


def _export(called: torch.nn.Module, node: Node) -> tuple[ExportedProgram, bool, list[tuple]]:
    """``called`` exported on zeros shaped like ``node``'s inputs (their symbolic dims dynamic)."""
    if node.kwargs or not all(isinstance(arg, Node) and isinstance(arg.meta.get("val"), torch.Tensor)
                              for arg in node.args):
        raise NotSupported(f"{node.target} is called with arguments other than tensors of the program")
    sizes: dict[str, int] = {}  # a symbolic size (its expression) -> the example's size for it
    examples, shapes, ours = [], [], []  # ours: each input's dims by the program's symbol (None: static)
    for arg in node.args:
        fake = arg.meta["val"]
        shape, spec = [], []
        ours.append([str(size) if isinstance(size, torch.SymInt) else None for size in fake.shape])
        for size in fake.shape:
            if isinstance(size, torch.SymInt):
                # distinct sizes past 1 (0 and 1 are specialised); one size per symbol, so dims that are
                # one size in the program are one size here
                shape.append(sizes.setdefault(str(size), 7 + 2 * len(sizes)))
                spec.append(Dim.DYNAMIC)
            else:
                shape.append(int(size))
                spec.append(Dim.STATIC)
        examples.append(torch.zeros(shape, dtype=fake.dtype, device=fake.device))
        shapes.append(tuple(spec))
    with torch.no_grad():
        returns_tuple = isinstance(called(*examples), tuple)
    with compat.tracing(), warnings.catch_warnings():  # one trace at a time in the process (compat.tracing)
        warnings.simplefilter("ignore")
        first = torch.export.export(called, tuple(examples), dynamic_shapes=(tuple(shapes),), strict=False)
        # again with each dynamic dim's range as the first export found it (a lower bound such as an
        # edit's position): a guard beyond that (code taking another path at some length) fails here
        bounds = {str(symbol): int(limits.lower) for symbol, limits in first.range_constraints.items()}
        symbols = [[str(size) if isinstance(size, torch.SymInt) else None for size in placeholder.meta["val"].shape]
                   for spec, placeholder in zip(first.graph_signature.input_specs,
                                                first.graph.find_nodes(op="placeholder"))
                   if spec.kind == InputKind.USER_INPUT]
        dims: dict[str, Dim] = {}
        shapes = [tuple(Dim.STATIC if symbol is None else
                        dims.setdefault(symbol, Dim(f"size{len(dims)}", min=bounds.get(symbol, 2))) for symbol in row)
                  for row in symbols]
        try:
            exported = torch.export.export(called, tuple(examples), dynamic_shapes=(tuple(shapes),), strict=False)
        except Exception as error:
            lines = [line.strip(" -") for line in str(error).splitlines() if line.strip()]
            raise NotSupported(f"what it computes depends on a size that varies between calls (the batch or the "
                               f"length): {' '.join(lines[:2])[:300]}") from error
    return exported, returns_tuple, _needs(called, examples, ours, symbols, bounds)


def _needs(called, examples: list[torch.Tensor], ours: list[list], symbols: list[list],
           bounds: dict[str, int]) -> list[tuple]:
    """``(input, dim, least size)`` for each size of the program (``ours``: each input's dims by the
    program's symbol) the module needs past 1: the export's lower bound (over the export's ``symbols``
    for that size) where it is past 2; at 2 (export's own assumption for every dynamic dim) only if the
    module fails with that size 1 in every input that has it (an edit's position 1). The saved graph
    asserts them, as the module itself refuses a call they do not hold (an ``EditError``) instead of
    computing something else."""
    needs = []
    for symbol in dict.fromkeys(symbol for row in ours for symbol in row if symbol is not None):
        least = max(bounds.get(theirs, 2) for row, their_row in zip(ours, symbols)
                    for mine, theirs in zip(row, their_row) if mine == symbol)
        if least == 2:
            small = [torch.zeros([1 if s == symbol else size for s, size in zip(row, example.shape)],
                                 dtype=example.dtype, device=example.device) for row, example in zip(ours, examples)]
            try:
                with torch.no_grad():
                    called(*small)
                least = 1
            except Exception:  # noqa: BLE001 (any refusal at size 1 is what the graph must assert)
                pass
        if least > 1:
            needs += [(i, d, least) for i, row in enumerate(ours) for d, s in enumerate(row) if s == symbol]
    return needs


def _splice(module: torch.nn.Module, node: Node, called: torch.nn.Module, exported: ExportedProgram,
            returns_tuple: bool, needs: list[tuple], what: str, held: dict[int, str]) -> None:
    """Copy ``exported``'s graph in place of ``node``, its parameters, buffers and constants read as
    tensors ``module`` holds, after an assertion of each of its ``needs`` (``what`` it is, in their messages)."""
    graph: Graph = module.graph
    stem = node.target.replace(".", "_")
    env, user = {}, iter(node.args)
    placeholders = exported.graph.find_nodes(op="placeholder")
    with graph.inserting_before(node):
        for index, dim, least in needs:
            size = graph.call_function(torch.ops.aten.sym_size.int, (node.args[index], dim))
            graph.call_function(torch.ops.aten._assert_scalar.default, (
                graph.call_function(operator.ge, (size, least)),
                f"{what} needs dim {dim} of its input to be at least {least} (as it refuses a smaller one)"))
        for spec, placeholder in zip(exported.graph_signature.input_specs, placeholders):
            if spec.kind == InputKind.USER_INPUT:
                env[placeholder] = next(user)
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                tensor = exported.constants[spec.target] if spec.kind == InputKind.CONSTANT_TENSOR else \
                    (called.get_parameter if spec.kind == InputKind.PARAMETER else called.get_buffer)(spec.target)
                env[placeholder] = graph.get_attr(_hold(module, tensor, f"{stem}__{spec.target}", held))
            else:
                raise NotSupported(f"{node.target} reads a {spec.kind.name.lower()} ({spec.target}), which a saved "
                                   f"program cannot hold")
        for inner in exported.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                results = list(torch.fx.node.map_arg(inner.args[0], env.__getitem__))
                break
            if inner.op == "get_attr":  # a higher-order op's body: a graph module of its own
                name = free_name(module, f"{stem}__{inner.target}")
                module.add_module(name, getattr(exported.graph_module, inner.target))
                env[inner] = graph.get_attr(name)
                continue
            env[inner] = graph.node_copy(inner, env.__getitem__)
    if returns_tuple:
        for reader in list(node.users):
            if reader.target is not operator.getitem or not isinstance(reader.args[1], int):
                raise NotSupported(f"{node.target}'s results are read other than by index")
            reader.replace_all_uses_with(results[reader.args[1]])
            graph.erase_node(reader)
    else:
        node.replace_all_uses_with(results[0])
    graph.erase_node(node)


def _hold(module: torch.nn.Module, tensor: torch.Tensor, name: str, held: dict[int, str]) -> str:
    """The attribute of ``module`` holding ``tensor`` (registered once, as a buffer, detached)."""
    if id(tensor) not in held:
        held[id(tensor)] = free_name(module, name)
        module.register_buffer(held[id(tensor)], tensor.detach())
    return held[id(tensor)]


def drop_submodule(module: torch.nn.Module, target: str) -> None:
    """Remove the submodule at the dotted ``target``."""
    parent, _, name = target.rpartition(".")
    delattr(module.get_submodule(parent), name)


def free_name(module: torch.nn.Module, name: str) -> str:
    """``name`` made a flat identifier that ``module`` does not use yet, not starting with ``_`` and not an
    attribute of a graph module (what a saved program's held tensors are named: ``fxdata.held_name``)."""
    stem = "".join(c if (c.isascii() and c.isalnum()) or c == "_" else "_" for c in name).lstrip("_") or "held"
    stem = f"t{stem}" if stem[0].isdigit() else stem
    name, index = stem, 1
    while hasattr(module, name) or hasattr(torch.fx.GraphModule, name):
        name, index = f"{stem}_{index}", index + 1
    return name
