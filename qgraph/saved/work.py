"""The work an untrusted graph can make one call do, as an expression of the call's sizes, known before it runs.

Bytes are bounded by the sandbox's fake run (``saved.sandbox``); this bounds time. Each node of the fake
run is given a count of floating-point operations from its op and its arguments' shapes (sympy expressions
of the call's size symbols): a contraction (``mm``, ``matmul``, ``linear``, ``einsum``, ``conv1d``,
``sdpa``, qgraph's delta-rule and expert kernels) its multiply-adds, counted twice; any other op the
elements it reads and writes (an elementwise op's work, within a small factor; ``sort``, ``topk`` and
``qgraph::qsa_select`` 16 times that: the selection is a ``topk`` of each query's scores and about a dozen
passes over its mask, its loop once per distinct number of blocks, at most once per query; and
``qgraph::qsa_blocks``, a stable sort of each row's mask and a gather of its keys). The graph's
work is their sum. What the count is checked against is the caller's: a saved program refuses a call over
``max_work`` (``qgraph.load``), the server a function edit that would do more than its request's own
forward (``serve``).
"""
from __future__ import annotations

from collections import Counter

import sympy
import torch
from torch.fx import Node

from .. import compat
from ..kernels.ops import CHUNK  # the chunked delta rule's chunk: its work within a chunk is quadratic in it
from .fxdata import OP_OVERLOAD

# ops whose work is a sort's: 16 x the elements they read and write
_ORDERING = ("aten.sort.default", "aten.argsort.default", "aten.topk.default",
             "qgraph.qsa_select.default", "qgraph.qsa_blocks.default")
_UNWRITTEN = ("aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default")  # no element touched


def _shape(tensor: torch.Tensor) -> list:
    return [sympy.sympify(compat.size_expression(size)) for size in tensor.shape]


def _numel(tensor) -> sympy.Expr:
    return sympy.Mul(*_shape(tensor)) if isinstance(tensor, torch.Tensor) else sympy.Integer(0)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return _tensors(list(value.values()))
    return []


def _einsum(equation: str, operands: list, out: torch.Tensor | None) -> sympy.Expr:
    """2 x the output's elements x every contracted index's size."""
    left, _, right = equation.replace(" ", "").partition("->")
    sizes: dict[str, sympy.Expr] = {}  # an index's letter -> its size
    for term, operand in zip(left.split(","), operands):
        head, dots, tail = term.partition("...")
        shape = _shape(operand)
        letters = list(head) + ([None] * (len(shape) - len(head) - len(tail)) if dots else []) + list(tail)
        for letter, size in zip(letters, shape):
            if letter is not None:
                sizes[letter] = sympy.Max(sizes.get(letter, 1), size)
    kept = set(right) if "->" in equation else {c for c in left if c.isalpha() and left.count(c) == 1}
    contracted = [size for letter, size in sizes.items() if letter not in kept]
    return 2 * _numel(out) * sympy.Mul(*contracted)


def _delta(args) -> sympy.Expr:
    """The delta rule over ``[b s h dk]`` keys and ``[b s h dv]`` values: per token and head, the state's
    ``dk x dv`` update and read, and the chunk's ``CHUNK x (dk + dv)``."""
    return 8 * _numel(args[2]) * (_shape(args[0])[-1] + CHUNK)


def _contraction(target: str, args: list, out) -> sympy.Expr | None:
    first = _tensors(out)[0] if _tensors(out) else None
    if target in ("aten.mm.default", "aten.bmm.default", "aten.matmul.default", "aten.linear.default"):
        return 2 * _numel(first) * _shape(args[0])[-1]
    if target in ("aten.addmm.default", "aten.baddbmm.default"):
        return 2 * _numel(first) * _shape(args[1])[-1] + _numel(first)
    if target == "aten.einsum.default":
        return _einsum(args[0], args[1], first)
    if target == "aten.conv1d.default":
        weight = _shape(args[1])
        return 2 * _numel(first) * weight[1] * weight[2]
    if target == "aten.scaled_dot_product_attention.default":
        query, key, value = (_shape(t) for t in args[:3])
        return sympy.Mul(*query[:-1]) * key[-2] * (2 * query[-1] + 2 * value[-1] + 5)
    if target in ("qgraph.chunk_gated_delta_rule.default", "qgraph.chunk_gated_delta_rule_states.default",
                  "qgraph.chunk_gated_delta_rule_writes.default"):
        return _delta(args)
    if target == "qgraph.delta_rule_attention.default":
        return 4 * _numel(first) * _shape(args[0])[-1]
    if target == "qgraph.moe_experts.default":
        gate_up, down = _shape(args[3]), _shape(args[4])
        return 2 * _numel(args[1]) * (gate_up[1] * gate_up[2] + down[1] * down[2])
    if target == "qgraph.moe_expert_neurons.default":
        gate_up = _shape(args[2])
        return 2 * _numel(args[1]) * gate_up[1] * gate_up[2]
    if target == "qgraph.moe_experts_down.default":
        down = _shape(args[3])
        return 2 * _numel(args[1]) * down[1] * down[2]
    return None


def node_work(target: str, args: list, kwargs: dict, out) -> sympy.Expr:
    """The floating-point operations of one node (``target`` its op's name), from its fake arguments and
    results: a contraction's, plus the elements it reads and writes."""
    if target in _UNWRITTEN:
        return sympy.Integer(0)
    traffic = sum((_numel(t) for t in _tensors((args, kwargs)) + _tensors(out)), sympy.Integer(0))
    if target in _ORDERING:
        traffic *= 16
    return traffic + (_contraction(target, args, out) or 0)


def graph_work(made: list) -> sympy.Expr:
    """The sum of ``node_work`` over ``made`` (``[(node, fake value)]`` of every node, in order, as the
    sandbox's fake run gives them); a node's arguments are the values of the nodes it names."""
    values: dict[Node, object] = {}
    counts: Counter = Counter()
    seen: dict = {}
    for node, value in made:
        values[node] = value
        if node.op != "call_function" or not isinstance(node.target, OP_OVERLOAD):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: values.get(n))
        key = (str(node.target), _key((args, kwargs)))
        if key not in seen:
            seen[key] = sympy.expand(node_work(str(node.target), list(args), dict(kwargs), value))
        counts[key] += 1
    return sympy.Add(*(count * seen[key] for key, count in counts.items())) if counts else sympy.Integer(0)


def _key(value):
    """What a node's work depends on: its tensors' shapes, and its literal arguments."""
    if isinstance(value, torch.Tensor):
        return ("t", tuple(map(str, map(compat.size_expression, value.shape))))
    if isinstance(value, (list, tuple)):
        return tuple(_key(item) for item in value)
    if isinstance(value, dict):
        return tuple((key, _key(item)) for key, item in value.items())
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return str(compat.size_expression(value))
    return repr(value)


def evaluate(work: sympy.Expr, sizes: dict) -> float:
    """``work`` at the call's ``sizes`` ({symbol: int})."""
    value = work.xreplace(sizes) if work.free_symbols else work
    return float(value) if not isinstance(value, float) else value



