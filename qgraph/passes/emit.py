"""Adding nodes the way export made them: each with a fake value (its shape and dtype) and the
module scope of the node it stands in for, so later passes can locate and reason about it."""
from __future__ import annotations

import torch
from torch.fx import Graph, Node


def fake_result(op, args):
    """The op's output on the arguments' fake values (shapes stay symbolic, nothing is computed)."""
    fakes = torch.fx.node.map_arg(args, lambda node: node.meta["val"])
    tensors = []
    torch.fx.node.map_aggregate(fakes, lambda value: tensors.append(value) if hasattr(value, "fake_mode") else None)
    if not tensors:  # arithmetic on symbolic sizes
        return op(*fakes)
    with tensors[0].fake_mode:
        return op(*fakes)


def emitter(graph: Graph, scope: Node):
    """A function ``emit(op, *args) -> Node`` adding calls that carry ``scope``'s module scope."""
    meta = {key: scope.meta[key] for key in ("nn_module_stack", "stack_trace") if key in scope.meta}

    def emit(op, *args) -> Node:
        node = graph.call_function(op, args)
        node.meta.update(meta)
        node.meta["val"] = fake_result(op, args)
        return node

    return emit
