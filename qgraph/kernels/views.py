"""Views a value is served through: resolved steps of a rule's ``view`` (see ``families.rules.Port``).

A resolved view is a tuple of steps: ``("unflatten", heads, head_dim)`` splits the last axis into
heads; ``("unsqueeze",)`` adds a leading axis of 1. Views never copy.
"""
from __future__ import annotations

import torch
from torch.fx import Graph, Node

from ..errors import InternalError


def resolve(view: tuple, size_of) -> tuple:
    """A rule's view steps (``("heads", dim, dim)``, ``("batch1",)``) with dims made sizes by ``size_of``."""
    steps: list[tuple] = []
    for step in view:
        if step[0] == "heads":
            steps.append(("unflatten", size_of(step[1]), size_of(step[2])))
        elif step[0] == "batch1":
            steps.append(("unsqueeze",))
        else:
            raise InternalError(f"unknown view step {step!r}")
    return tuple(steps)


def apply(x: torch.Tensor, view: tuple) -> torch.Tensor:
    for step in view:
        x = x.unflatten(-1, step[1:]) if step[0] == "unflatten" else x.unsqueeze(0)
    return x


def undo(x: torch.Tensor, view: tuple) -> torch.Tensor:
    for step in reversed(view):
        x = x.flatten(-2) if step[0] == "unflatten" else x.squeeze(0)
    return x


def emit(graph: Graph, node: Node, view: tuple) -> Node:
    """Nodes computing ``apply(node, view)``, inserted before the output."""
    with graph.inserting_before(graph.output_node()):
        for step in view:
            if step[0] == "unflatten":
                node = graph.call_function(torch.ops.aten.unflatten.int, (node, -1, list(step[1:])))
            else:
                node = graph.call_function(torch.ops.aten.unsqueeze.default, (node, 0))
    return node
