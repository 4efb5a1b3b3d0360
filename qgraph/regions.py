"""A program cut into regions: what precedes the blocks, each block, what follows them; alike regions grouped.

``torch.compile`` of a whole program costs time per node, so a deep model compiles for long though its
blocks of one kind compute the same thing on other weights. Cut at block boundaries
(``distributed.split.split_by``), each block is a region whose parameters are inputs like its
activations, and blocks of one kind that tap and edit the same values have the same graph up to
names: one ``GraphModule`` per group of alike regions (one code object for dynamo, one graph for
inductor), called with each region's tensors, compiles once (``qgraph.compile``).

A node is in a block when its module scope (``nn_module_stack``) lies in one of the family's block
lists (``Family.repeated_blocks``: the text blocks, the vision blocks). A node in some other module's
scope (the embedding, the rotary, the masks; the final norm, the lm_head) belongs to the region before
the first block or the one after the last; what the passes added (taps, edit slots) goes with what it
reads, as in ``split``, and so does a node in another module's scope between two blocks. Two regions
are alike when their graphs are: the same ops in the same order on the same operands, the same constants
(small tensors by value) and the same module objects (an edit slot is its own), and inputs of the same
dtypes and shapes (``structure``).
"""
from __future__ import annotations

import re
from operator import attrgetter
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .distributed.split import Plan, split_by


@dataclass
class Regions:
    """A program's regions (``plan``: one stage each, in order) and their groups of alike ones."""

    plan: Plan
    group: list[int]  # per region, its group (an index into ``modules``)
    modules: list[GraphModule]  # per group, the module every region of the group runs

    def __len__(self) -> int:
        return len(self.plan)


def regions_of(module: GraphModule, block_lists, model_paths: set[str]) -> Regions:
    """Cut a built program into regions and group them; ``block_lists`` are the paths of the model's block
    lists (``model.layers``), ``model_paths`` the paths of all its modules (what counts as a scope)."""
    block = re.compile("^(?:" + "|".join(map(re.escape, block_lists)) + r")\.\d+(?=\.|$)") if block_lists else None
    nodes = [node for node in module.graph.nodes if node.op not in ("placeholder", "output")]
    index = {node: position for position, node in enumerate(nodes)}
    scopes = {node: _scope(node, block, model_paths) for node in nodes}
    inside = [index[node] for node in nodes if scopes[node]]  # the positions of the blocks' nodes
    first, last = (inside[0], inside[-1]) if inside else (len(nodes), len(nodes))
    order: dict[str, int] = {}  # each block's path, in the order its nodes start
    for scope in scopes.values():
        if scope:
            order.setdefault(scope, len(order))
    offset = int(any(scopes[node] == "" for node in nodes[:first]))  # a region before the blocks
    after = any(scopes[node] == "" for node in nodes[last + 1:])  # and one after them

    def stage_of(node: Node) -> int | None:
        scope = scopes[node]
        if scope:
            return order[scope] + offset
        if scope == "" and index[node] < first:
            return 0
        if scope == "" and index[node] > last:
            return offset + len(order)
        return None  # no module's scope (a node the passes added), or one between blocks: with its inputs

    plan = split_by(module, stage_of, max(1, offset + len(order) + int(after)))
    groups: dict[tuple, int] = {}
    group: list[int] = []
    modules: list[GraphModule] = []
    for stage in plan.modules:
        key = structure(stage)
        if key not in groups:
            groups[key] = len(modules)
            modules.append(stage)
        group.append(groups[key])
    return Regions(plan, group, modules)


def _scope(node: Node, block, model_paths: set[str]) -> str | None:
    """The block path a node's module scope lies in (``model.layers.3``), "" for a scope outside the
    blocks, None for no scope (a node the passes added; export's size reads)."""
    scope = None
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        found = block.match(path) if block is not None else None
        if found:
            return found.group(0)
        if path in model_paths:
            scope = ""
    return scope


def structure(module: GraphModule) -> tuple:
    """What a region computes, up to names: per node its op, its target (a module, constant or function
    object, by identity), its arguments with nodes as positions; per input its dtype and shape."""
    position = {node: index for index, node in enumerate(module.graph.nodes)}

    def plain(value):
        if isinstance(value, Node):
            return ("node", position[value])
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, *(plain(item) for item in value))
        if isinstance(value, dict):
            return ("dict", *((key, plain(item)) for key, item in value.items()))
        if isinstance(value, torch.Tensor):  # a constant, by identity (== would compare elements)
            return ("object", id(value))
        if isinstance(value, slice):
            return ("slice", plain(value.start), plain(value.stop), plain(value.step))
        try:
            hash(value)
        except TypeError:
            return ("object", id(value))
        return (type(value).__name__, value)

    key = []
    for node in module.graph.nodes:
        target: object
        if node.op == "placeholder":
            value = node.meta.get("val")
            target = (str(value.dtype), tuple(str(size) for size in value.shape), value.device.type) \
                if isinstance(value, torch.Tensor) else type(value).__name__
        elif node.op == "get_attr":
            target = _constant(attrgetter(node.target)(module))
        elif node.op == "call_module":
            target = ("object", id(module.get_submodule(node.target)))
        else:
            target = plain(node.target)
        key.append((node.op, target, plain(node.args), plain(dict(node.kwargs))))
    return tuple(key)


def _constant(value) -> tuple:
    """A constant of a region (a lifted tensor, say), by value where it is small (each block's copy of one
    scalar is alike), else by identity."""
    if isinstance(value, torch.Tensor) and value.numel() <= 16 and value.device.type != "meta":
        return ("tensor", str(value.dtype), tuple(value.shape), tuple(value.flatten().tolist()))
    return ("object", id(value))
