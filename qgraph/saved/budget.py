"""What loading a saved program may cost, and the checks that hold an untrusted graph to it as it is read.

Loading is linear in the graph's size. ``schema`` refuses a ``graph.json`` past ``GRAPH_BYTES`` before it is
inflated and past ``CONTAINERS`` lists and objects before it is parsed; ``fxdata`` a graph past ``NODES``
nodes before any node is read, and past ``ITEMS`` argument items as it reads them. Each node then costs
its decoding, one fx node, a lookup in the fake run's per-kind reuse (``sandbox._propagate``) and, once
the graph passed, a line of generated code. What a node can cost beyond that is bounded here, node by
node, as the fake run goes (a refusal stops it at once, naming the node):

- **Fake calls.** A kind of call not seen before runs once on fake tensors (milliseconds each; the blocks
  of a model repeat their kinds): at most ``CALLS`` of them, an op that splits a tensor counted once per
  piece, told before it runs (an ``unbind`` of a dim of a million is a million tensors made by one node),
  and at most ``OPS`` ops run by them (a composite op runs its decomposition's: a ``cumsum`` 34).
- **Symbolic sizes stay small.** torch reasons about each symbolic size with sympy, whose work grows far
  faster than the expression (a reshape between two products of sums expands and simplifies them; a size
  squared 60 times is a number of 2**60 digits). Every size a node makes (a tensor's dims, strides,
  offset and element count, or a size computed by the graph's arithmetic) must be as small as a model's:
  at most ``ATOMS`` symbols, numbers and operations, ``TERMS`` terms once multiplied out and degree
  ``SIZE_DEGREE``; a number the size arithmetic makes must be an int64, and its powers small ones.

Every refusal is a ``SavedProgramError`` naming the node and the bound. The figures behind each limit
are in benchmarks/results.md ("Issue 53: loading time", ``benchmarks/bench_load.py``).
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable

import sympy
import torch
from torch.fx import Node

from .. import compat
from ..errors import SavedProgramError
from .fields import integer
from .allowed import FUNCTIONS

# The budget: loading the largest graph these limits allow takes about 12 s and 0.5 GiB on a 2-core
# machine shared with other work, ~6 s for its nodes and ~6 s for its fake calls (benchmarks/bench_load.py
# --largest 500: 50,000 nodes, 500 of them a costly kind each, 11.6 s and 473 MiB). The largest legitimate program is
# far inside them: every value and an edit slot at every editable value of the 0.8B shape (24 blocks) is
# 4,558 nodes, 0.8 MiB of graph.json, 241 fake calls running 1,195 ops; a 64-block model asked the same
# is about 12,000 nodes and the same fake calls (the blocks repeat).
NODES = 50_000  # a node costs ~120 µs and ~10 KiB at the peak (fx's code for it, compiled): ~6 s, ~0.5 GiB
ITEMS = 4 * NODES  # argument items (each argument, list item, node reference): a model's program has 3.8 a node
GRAPH_BYTES = 16 * 2**20  # inflated graph.json (a model's program: ~180 B a node)
# JSON lists and objects ([ and {, counted in the bytes before they are parsed: 16 MiB of "[[[[]]]]" would
# parse into ~0.7 GiB of lists); a model's program has 4.2 a node, qgraph.json ~1.5 a value
CONTAINERS = {"graph.json": 8 * NODES, "qgraph.json": 2**18}
CALLS = 1_024  # fake calls; one runs 1 to 60 ops (a cumsum 34, a one_hot 59: its decomposition's)
OPS = 8_192  # ops those fake calls run, 0.3 to 1.6 ms each (a sort on symbolic sizes ~5 ms, but 1 op): ~6 s
ATOMS = 32  # a model's sizes have at most 6 (128*s0*(s1 + 3)): 5x
TERMS = 4  # multiplied out; a model's have at most 2 (4*s0*s1 + 1); 8 let a reshape cost ~70 ms
SIZE_DEGREE = 6  # a model's element counts have degree 3 (batch × length²); twice that
POWER = 64  # the largest exponent of the size arithmetic's ** (a model's graph has none)
_INT, _INT64 = integer(), integer(-2**63, 2**63 - 1)
DIMS = 16  # dims of a tensor a node makes (a model's have at most 6; an input's or held tensor's at most 16)
WHY = ("a saved program is bounded so that loading it takes seconds (docs/security.md); save one with fewer values "
       "or edit slots")


# the ops whose number of results is one of their arguments' (the rest return a fixed number): op -> that
# number from the dim's size and the op's other arguments (not an int where the op refuses those)
_PIECES: dict[str, Callable[..., object]] = {
    "aten.unbind.int": lambda size, dim=0: size,
    "aten.split.Tensor": lambda size, split_size, dim=0: -(-size // split_size) if split_size > 0 else 1,
    "aten.split_with_sizes.default": lambda size, split_sizes, dim=0: len(split_sizes),
    "aten.tensor_split.indices": lambda size, indices, dim=0: len(indices) + 1,
    "aten.chunk.default": lambda size, chunks, dim=0: min(chunks, size) if chunks > 0 else 1,
}
PIECES = frozenset(_PIECES)
_NAMES = {id(function): name for name, function in FUNCTIONS.items()}  # operator.mul, not <built-in ...>


class Meter:
    """The budget of one fake run (``sandbox._propagate``) in ``mode``: ``call`` before each fake call,
    ``made`` after each node with what it made."""

    def __init__(self, where: str, mode):
        self.where, self.mode, self.calls = where, mode, 0
        self._checked: set[int] = set()  # ids of values already checked (a reused result is checked once)

    def fail(self, node: Node, why: str):
        raise SavedProgramError(f"{self.where}: node {node.name} ({_NAMES.get(id(node.target), node.target)}) {why}")

    def call(self, node: Node, target, args: tuple, kwargs: dict) -> None:
        """Count a fake call of ``target`` (its pieces, for an op that splits), refusing one past the budget
        or a power of the size arithmetic past ``POWER``."""
        if target is operator.pow:
            exponent = args[1] if len(args) == 2 else None
            if not integer(0, POWER)(exponent):
                self.fail(node, f"raises a size to the power {str(exponent)[:40]}; the size arithmetic of a saved "
                                f"program raises to integer powers of 0 to {POWER} only")
        pieces = self._pieces(target, args, kwargs)
        self.calls += pieces
        if self.calls > CALLS:
            made = f"makes {pieces:,} tensors, " if pieces > 1 else ""
            self.fail(node, f"{made}past the {CALLS:,} kinds of op call a saved program's graph may check (each "
                            f"kind runs once on fake tensors, a split once per piece; a model's program has a few "
                            f"hundred, its blocks repeating them): {WHY}")

    @staticmethod
    def _pieces(target, args: tuple, kwargs: dict) -> int:
        """How many tensors the call makes, counted before it runs for an op that splits (else 1)."""
        split = _PIECES.get(str(target))
        if split is None or not args or not isinstance(args[0], torch.Tensor) or args[0].dim() == 0:
            return 1
        names = compat.op_argument_names(target)
        bound = {**dict(zip(names, args)), **kwargs}
        tensor, dim = args[0], bound.get("dim", 0)
        if not isinstance(dim, int) or not -tensor.dim() <= dim < tensor.dim():
            return 1  # the op refuses it
        try:
            pieces = split(_hint(tensor.shape[dim]), *(_hint(bound[n]) for n in names[1:] if n != "dim" and n in bound))
        except (TypeError, ValueError, ZeroDivisionError):
            return 1  # arguments the op refuses
        return max(1, pieces) if isinstance(pieces, int) else 1

    def made(self, node: Node, value) -> None:
        """Refuse ``value`` (what ``node`` made) if a size in it is past the bounds (or a number of the
        size arithmetic past an int64), or the run past ``OPS`` ops."""
        ops = getattr(self.mode, "dispatches", 0)
        if ops > OPS:
            self.fail(node, f"takes the fake run past {OPS:,} ops (the ops of each kind of call, and of their "
                            f"decompositions: a model's program runs about 1,200): {WHY}")
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if id(item) in self._checked:
                continue
            if isinstance(item, torch.Tensor):
                if item.dim() > DIMS:
                    self.fail(node, f"makes a tensor of {item.dim()} dims, more than a saved program's ({DIMS})")
                dims = [*item.shape, *item.stride(), item.storage_offset()]
                for size in dims:
                    self._size(node, compat.size_expression(size))
                self._size(node, compat.size_expression(item.numel()), element_count=True)
                self._checked.add(id(item))
            elif isinstance(item, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                self._size(node, item.node.expr)
            elif _INT(item) and not _INT64(item):
                self.fail(node, f"computes the number {str(item)[:40]}..., past the int64 a size is")

    def _size(self, node: Node, expression, element_count: bool = False) -> None:
        if _INT(expression):
            if not -2**63 <= expression < 2**63 and not element_count:
                self.fail(node, f"makes a size of {str(expression)[:40]}..., past the int64 a size is")
            return
        if not isinstance(expression, sympy.Basic) or not expression.free_symbols:
            return
        atoms, terms, degree = measure(expression, ATOMS * (17 if element_count else 1))
        limit = ATOMS * (17 if element_count else 1)  # an element count: the product of up to 16 dims
        if atoms > limit or terms > TERMS or degree > SIZE_DEGREE:
            shown = str(expression) if atoms <= limit else "an expression"
            self.fail(node, f"makes a size of {shown[:200]} (of {'more than ' if atoms > limit else ''}{atoms} "
                            f"parts, {terms} terms multiplied out, degree {degree}), larger than any size a saved "
                            f"program computes (at most {ATOMS} parts, {TERMS} terms, degree {SIZE_DEGREE})")


def _hint(value):
    """A symbolic size as the fake run's example of it (what the op's loop over it runs to)."""
    return compat.size_hint(value) if isinstance(value, torch.SymInt) else value


def measure(expression, limit: int) -> tuple[int, int, int]:
    """``(parts, terms, degree)`` of a sympy expression, without multiplying it out: its atoms and operations
    (counting stops past ``limit``: then only that is known, and the rest is ``(0, 0)``), how many terms it
    has at most multiplied out, and its degree at most (a floor division, remainder or max as of its
    arguments)."""
    parts, stack = 0, [expression]
    while stack:
        parts += 1
        if parts > limit:
            return parts, 0, 0
        stack.extend(stack.pop().args)
    return parts, *_terms_degree(expression)


def _terms_degree(expression) -> tuple[int, int]:
    if isinstance(expression, sympy.Symbol):
        return 1, 1
    if not expression.args:
        return 1, 0
    inner = [_terms_degree(arg) for arg in expression.args]
    if isinstance(expression, sympy.Add):
        return sum(t for t, _ in inner), max(d for _, d in inner)
    if isinstance(expression, sympy.Mul):
        return math.prod(t for t, _ in inner), sum(d for _, d in inner)
    if isinstance(expression, sympy.Pow):
        exponent = expression.exp
        if exponent.is_Integer and 0 <= int(exponent) <= POWER:
            n = int(exponent)
            return inner[0][0] ** n, inner[0][1] * n
        return 2**31, 2**31  # a symbolic, fractional or negative power: no size of a model's
    # FloorDiv, Mod, Max, Min, comparisons, ...: as large as their largest argument (or their sum)
    return sum(t for t, _ in inner), max(d for _, d in inner)
