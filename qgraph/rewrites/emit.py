"""Adding nodes the way export made them: each with a fake value (its shape and dtype) and the
module scope of the node it stands in for, so later passes can locate and reason about it."""
from __future__ import annotations

import contextlib

import torch
from torch.fx import Graph, Node


def fake_result(op, args, kwargs=None):
    """The op's output on the arguments' fake values (shapes stay symbolic, nothing is computed). What the op
    assumes of the sizes is not recorded: the fake values are shared by every program of one export, and a
    pass's assumption (generation's decode step puts examples of one batch beside the program's symbolic
    batch) would otherwise make the export's sizes that example's for every later program (a saved one)."""
    fakes = torch.fx.node.map_arg(args, lambda node: node.meta["val"])
    kwargs = kwargs or {}
    tensors = []
    torch.fx.node.map_aggregate(fakes, lambda value: tensors.append(value) if hasattr(value, "fake_mode") else None)
    if not tensors:  # arithmetic on symbolic sizes
        return op(*fakes, **kwargs)
    mode = tensors[0].fake_mode
    with mode, (mode.shape_env.suppress_guards() if mode.shape_env is not None else contextlib.nullcontext()):
        return op(*fakes, **kwargs)


def emitter(graph: Graph, scope: Node):
    """A function ``emit(op, *args, **kwargs) -> Node`` adding calls that carry ``scope``'s module scope."""
    meta = _scope(scope)

    def emit(op, *args, **kwargs) -> Node:
        node = graph.call_function(op, args, kwargs or None)
        node.meta.update(meta)
        node.meta["val"] = fake_result(op, args, kwargs)
        return node

    return emit


def emit_module(graph: Graph, scope: Node, target: str, args: tuple, like: torch.Tensor) -> Node:
    """A call of the submodule ``target`` carrying ``scope``'s module scope, whose output is shaped
    like the fake tensor ``like`` (a submodule's output is not computed on fakes: its weights are real)."""
    node = graph.call_module(target, args)
    node.meta.update(_scope(scope))
    with like.fake_mode:  # type: ignore[attr-defined]  # a FakeTensor's (torch._subclasses): torch's stubs say Tensor
        node.meta["val"] = like.new_empty(like.shape)
    return node


class MethodCall(torch.nn.Module):
    """One method of a module as a module of its own (``call_module`` calls ``forward``): how a pass
    calls an SAE's or a transcoder's ``encode``, ``decode``, ... in the graph."""

    def __init__(self, owner: torch.nn.Module, method: str):
        super().__init__()
        self.owner, self.method = owner, method

    def forward(self, *args):
        return getattr(self.owner, self.method)(*args)


def _scope(node: Node) -> dict:
    return {key: node.meta[key] for key in ("nn_module_stack", "stack_trace") if key in node.meta}
