"""Which tensors of an untrusted graph may share storage with what it was given, decided by construction.

A node's results are new storage only if its op is on the positive list ``allowed.FRESH`` (aten ops that
always allocate, and qgraph's kernels, which torch forbids to alias an input). Every other op's results are
taken to alias *every* tensor argument of the node, whatever its schema says: a view says so, but
``_unsafe_view`` does not, a cast returns its input itself when nothing changes, ``dropout`` in eval mode
and a one-operand ``einsum`` hand back their input, and ``split`` or ``unbind`` return lists whose items
the schema links to nothing. A list's items alias whatever the list may alias (``getitem``). So a missing
or loose annotation can only make the sandbox refuse more, never let a write or a view through.

On that, two refusals, at load (``qgraph.load`` and ``qgraph check``), before anything runs:
- an op that writes in place (its schema marks an argument written) may write only a tensor the graph
  made itself, and only if it is one of ``allowed.INPLACE``: never an input (the caller's weights,
  ``input_ids``), a held tensor (``inv_freq``), nor anything that may alias one;
- no output may be, or alias, a weight or a held tensor (the call's own inputs may come back: a value of
  ``input_ids``).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from .. import compat
from ..errors import SavedProgramError
from .allowed import FRESH, INPLACE
from .fxdata import OP_OVERLOAD



def check(graph: torch.fx.Graph, calls: set, where: str) -> None:
    """Refuse ``graph`` if it writes into, or returns, storage it did not make (``calls``: the
    placeholders of the call's own inputs, which it may return)."""
    roots: dict[Node, frozenset] = {}  # node -> the inputs and held tensors its value may share storage with
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            roots[node] = frozenset((node,))
        # anything else (the size arithmetic between ops: ints) shares nothing
        elif node.op == "call_function" and node.target is operator.getitem:  # an item of a list of results
            roots[node] = _roots(node.args[0], roots)
        elif node.op == "call_function" and isinstance(node.target, OP_OVERLOAD):
            _writes(node, roots, where)
            schema = compat.op_schema(node.target)
            tensors = any("Tensor" in str(result.type) for result in schema.returns)
            roots[node] = _roots((node.args, node.kwargs), roots) \
                if tensors and str(node.target) not in FRESH else frozenset()
        elif node.op == "output":
            hit = _roots(node.args, roots) - calls
            if hit:
                raise SavedProgramError(f"{where}: the graph returns {_named(hit)} (or a view of it): a saved program "
                                        f"returns tensors it computed, never its weights or held tensors")


def _writes(node: Node, roots: dict, where: str) -> None:
    schema = compat.op_schema(node.target)
    bound = dict(zip((a.name for a in schema.arguments if not a.kwarg_only), node.args))
    bound.update(node.kwargs)
    for argument in schema.arguments:
        info = argument.alias_info
        if info is None or not info.is_write or argument.name not in bound:
            continue
        hit = _roots(bound[argument.name], roots)
        if hit or str(node.target) not in INPLACE:
            raise SavedProgramError(f"{where}: node {node.name} ({node.target}) writes in place into "
                                    f"{_named(hit) if hit else 'its argument ' + argument.name}: a saved program may "
                                    f"write only tensors it made itself")


def _roots(value, roots: dict) -> frozenset:
    """The inputs and held tensors that ``value`` (an argument: a node, or lists, tuples and dicts of
    them) may share storage with."""
    if isinstance(value, Node):
        return roots.get(value, frozenset())
    if isinstance(value, (list, tuple)):
        return frozenset().union(*(_roots(item, roots) for item in value))
    if isinstance(value, dict):
        return _roots(list(value.values()), roots)
    return frozenset()


def _named(nodes) -> str:
    return ", ".join(sorted(f"{'its input' if n.op == 'placeholder' else 'its held tensor'} {n.name}" for n in nodes))
