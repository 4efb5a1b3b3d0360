"""Which box each node of a block is drawn in: its module scope, its op, or the wire it rides on.

* ``detail="ops"``: every graph node is a box of its own (port markers ride on the wires).
* ``detail="modules"``: a leaf module's nodes are one box; between modules, re-views, casts and
  markers are wires, what is computed from parameters alone feeds labels (no box), what is computed
  from a mask or the position embeddings alone is part of that input, the rotary's slices and
  rotations are one box per use, and elementwise runs fuse into the box before them. Ops join
  boxes through a ``networkx`` union-find; the rotary's boxes are connected components.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import networkx as nx
import torch
from networkx.utils import UnionFind
from torch.fx import Node

from ..kernels.ops import MARK_OP
from .graph import SDPA, SHAPE_ONLY, is_pass_through, is_tensorish, tensor_inputs
from .host import BlockHost
from .skeleton import located

if TYPE_CHECKING:  # a type only: the catalogue's entries
    from ..values.catalogue import Entry

aten = torch.ops.aten

# elementwise ops that may join the box of the op before them (one input from it, its only reader)
FUSABLE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default, aten.exp.default,
    aten.log.default, aten.sigmoid.default, aten.silu.default, aten.softplus.default, aten.tanh.default,
    aten.gelu.default, aten.relu.default, aten.slice.Tensor, aten.pow.Tensor_Scalar, aten.rsqrt.default,
    aten.where.self, aten.where.ScalarOther, aten.masked_fill.Scalar,
}
ROTARY_OPS = {aten.slice.Tensor, aten.neg.default, aten.cat.default, aten.mul.Tensor, aten.add.Tensor}
MULTI_OUTPUT = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int}


def is_core(node: Node) -> bool:
    """The op a mixer is built around: sdpa, or one of qgraph's kernels (delta rule, packed vision attention)."""
    if node.target is SDPA:
        return True
    namespace = getattr(node.target, "namespace", None)
    return namespace == "qgraph" and node.target is not MARK_OP


class BlockGrouping(BlockHost):
    """What is in block ``prefix`` of ``view`` and which group (drawn box) each of its nodes is in.

    Sets ``nodes``, ``inside``, ``scopes``, ``leaves`` (the leaf modules), ``residual_in``, ``values``
    and ``groups``; with modules detail also ``kinds``, ``const`` (computed from parameters alone),
    ``context`` (computed from a mask or the position embeddings alone), ``rotary`` and ``value_roots``.
    """

    def _block_nodes(self) -> list[Node]:
        view = self.view
        nodes = [n for n in view.graph.nodes if view.in_scope(n, self.prefix)]
        scopes = {s for n in nodes for s in view.scopes(n) if s == self.prefix or s.startswith(self.prefix + ".")}
        self.leaves = {s for s in scopes if s != self.prefix and not any(o.startswith(s + ".") for o in scopes)}
        self.scopes = scopes
        marker = view.locator.ports.get(f"{self.prefix}.input")
        self.residual_in = marker.args[0] if marker is not None else None
        self.values = self._values()
        self.kinds, self.const, self.rotary, self.context, self.value_roots = {}, {}, set(), {}, set()
        return nodes

    def _values(self) -> dict[str, Entry]:
        """Every standard value of the block, and the highlighted ports on it, by name."""
        names = {}
        for name, entry in self.view.catalogue.items():
            on_block = entry.host == self.prefix or entry.host.startswith(self.prefix + ".")
            if on_block and (entry.spec is not None or name in self.highlight):
                names[name] = entry
        return names

    def _absorbed(self, node: Node) -> bool:
        """Whether ``node`` is drawn as part of the wire from its input (not a box of its own)."""
        if node not in self.inside:
            return False
        if node.target is MARK_OP:
            return True
        if self.detail == "ops":
            return False
        return (node.target is operator.getitem or self.view.scope(node) not in self.leaves) and is_pass_through(node)

    def _root(self, node: Node) -> Node:
        """The node whose tensor ``node`` carries on (itself unless it is absorbed into a wire)."""
        while node in self.inside and self._absorbed(node):
            node = node.args[0]
        return node

    def _carriers(self, node: Node) -> list[Node]:
        """``node`` and the absorbed nodes inside that carry its tensor on."""
        found, stack = [node], [node]
        while stack:
            current = stack.pop()
            for user in current.users:
                if self._absorbed(user) and user.args and user.args[0] is current:
                    found.append(user)
                    stack.append(user)
        return found

    # -- what flows in and out -----------------------------------------------------------------
    def _context_kind(self, node: Node) -> str | None:
        """"position" for the rotary's cos/sin, "mask" for masks built from attention_mask, else None."""
        if node in self.inside:
            return self.context.get(node)
        if self.view.is_param(node) or node is self.residual_in:
            return None
        if any("rotary" in s.rsplit(".", 1)[-1] for s in self.view.scopes(node)):
            return "position"
        if "attention_mask" in self.view.ancestors_inputs(node):
            return "mask"
        return "other"

    def _is_const(self, node: Node) -> bool:
        return self.const.get(node, False) if node in self.inside else self.view.is_param(node)

    def _outside_group(self, node: Node):
        if self.view.is_param(node):
            return ("param", node.name) if self.detail == "ops" else None
        if node is self.residual_in:
            return ("in", "residual")
        if not is_tensorish(node):
            return None
        kind = self._context_kind(node)
        return ("in", kind if kind != "other" else node.name)

    def _group_of(self, node: Node):
        """The group a node's tensor leaves from: its box inside, or where it comes from outside."""
        return self.groups.get(node) if node in self.inside else self._outside_group(node)

    def _sink(self, user: Node):
        if user.op == "output":
            return ("out", "output")
        if not is_tensorish(user) and user.target is not MARK_OP:
            return None
        scope = self.view.scopes(user)
        return ("out", scope[0] if scope else "the model")

    # -- grouping --------------------------------------------------------------------------------
    def _group(self):
        if self.detail == "ops":
            for node in self.nodes:
                if node.target is not MARK_OP:
                    self.groups[node] = ("op", node.name)
        else:
            self._group_modules()
        for node in self.nodes:  # what rides on a wire is drawn with the box it leaves
            rides = node.target is MARK_OP if self.detail == "ops" else self.kinds[node] == "pass"
            if rides:
                self.groups[node] = self._group_of(self._root(node))

    def _group_modules(self):
        view = self.view
        self._classify()
        kinds, const = self.kinds, self.const
        compute = [n for n in self.nodes if kinds[n] == "compute" and not const[n] and n not in self.context]
        self.value_roots = {self._root(node) for node in map(located, self.values.values()) if node is not None}
        boxes = _Boxes(compute, view.index)
        self._join_rotary(compute, boxes)
        self._fuse_elementwise(compute, boxes)
        for node in self.nodes:
            kind = kinds[node]
            if kind == "module":
                self.groups[node] = ("module", view.scope(node))
            elif kind == "compute" and node in self.context:
                self.groups[node] = ("in", self.context[node])
            elif kind == "compute" and not const[node]:
                self.groups[node] = ("op", boxes.head(node).name)

    def _classify(self):
        """Each node's kind (pass, hidden, module, compute), whether it is computed from parameters
        alone, and what the block computes from a mask or the position embeddings alone."""
        view, kinds, const = self.view, self.kinds, self.const
        for node in self.nodes:
            if self._absorbed(node):
                kinds[node] = "pass"
            elif not is_tensorish(node):
                kinds[node] = "hidden"
            elif view.scope(node) in self.leaves:
                kinds[node] = "module"
            else:
                kinds[node] = "compute"
            const[node] = node.target not in SHAPE_ONLY and all(
                (u in self.inside and const.get(u, False)) or (u not in self.inside and view.is_param(u))
                for u in tensor_inputs(node))
        for node in self.nodes:
            if kinds[node] == "compute" and not const[node]:
                roots = [self._root(u) for u in tensor_inputs(node)]
                sides = [self._context_kind(r) for r in roots if not self._is_const(r)]
                if sides and all(sides):
                    self.context[node] = sides[0]

    def _join_rotary(self, compute, boxes: _Boxes):
        """The rotary: slices, rotations and products that read the position embeddings, one box per use
        (a connected component of such ops in one scope, reached from one that reads cos/sin)."""
        candidates = {n for n in compute if n.target in ROTARY_OPS}
        linked = nx.Graph()
        linked.add_nodes_from(candidates)
        for node in candidates:
            neighbours = [self._root(u) for u in tensor_inputs(node)] + [
                u for d in self._carriers(node) for u in d.users]
            linked.add_edges_from((node, other) for other in neighbours
                                  if other in candidates and self.view.scope(other) == self.view.scope(node))
        seeds = {n for n in candidates if any(
            self._context_kind(self._root(u)) == "position" for u in tensor_inputs(n))}
        for region in nx.connected_components(linked):
            if region & seeds:
                boxes.join(*region)
                self.rotary |= region

    def _fuse_elementwise(self, compute, boxes: _Boxes):
        """Fuse an elementwise op into the box before it when that box feeds only it."""
        view = self.view
        for node in compute:
            if node in self.rotary or node.target not in FUSABLE:
                continue
            roots = [self._root(u) for u in tensor_inputs(node)]
            sources = {boxes.head(r) for r in roots if r in boxes}
            others = [r for r in roots if r not in boxes and not self._context_kind(r) and not self._is_const(r)]
            if len(sources) != 1 or others:
                continue
            head = next(iter(sources))
            members = boxes.members(head)
            if (head in self.rotary or head.target in MULTI_OUTPUT or is_core(head)
                    or any(m in self.value_roots for m in members) or view.scope(head) != view.scope(node)):
                continue
            readers = {u for m in members for d in self._carriers(m) for u in d.users
                       if not self._absorbed(u) and is_tensorish(u) and u.target not in SHAPE_ONLY}
            if readers - set(members) == {node}:
                boxes.join(head, node)


class _Boxes:
    """Compute nodes joined into boxes (a ``networkx`` union-find); a box is named by its first node."""

    def __init__(self, nodes, index: dict[Node, int]):
        self.nodes, self.index = list(nodes), index
        self.sets = UnionFind(self.nodes)
        self.first = {node: node for node in self.nodes}  # set root -> the box's first node in graph order

    def __contains__(self, node) -> bool:
        return node in self.first

    def head(self, node: Node) -> Node:
        return self.first[self.sets[node]]

    def join(self, *nodes: Node) -> None:
        first = min((self.head(n) for n in nodes), key=self.index.__getitem__)
        self.sets.union(*nodes)
        self.first[self.sets[nodes[0]]] = first

    def members(self, head: Node) -> list[Node]:
        return [n for n in self.nodes if self.head(n) is head]
