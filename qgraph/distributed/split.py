"""Cut a built program at block boundaries into stages (``torch.fx.passes.split_module``).

A node belongs to the stage of the block its module scope (``nn_module_stack``) names, or to the
latest stage among its inputs, whichever is later: what precedes the first block (the embedding,
the rotary, the masks) is stage 0, what follows the last (the final norm, the lm_head) is the last
stage, and what a pass added (taps, edit slots, views) goes with what it reads. A node that reads
only program inputs and lies in no block (a parameter's ``1 + weight``, export's checks on a
parameter) goes to the earliest stage that uses it (or its parameter), so no stage computes for
another what it could compute itself, nor reads a parameter it does not need. The size of a program
input (a ``sym_size`` of ``input_ids``, say) is computed again in every stage that reads it, so only
tensors cross stages: a stage's sizes follow the inputs it is given (a pipeline sends fewer messages,
and a patching sweep can run a stage on a larger batch than the stages before it ran on).

``split`` cuts before given blocks; ``split_by`` takes each node's stage from a function of its scope
(``qgraph.regions`` cuts before and after every block that way, for ``compile=True``).

``Plan`` says, for each stage, where each of its inputs comes from (a program input, or an output
of an earlier stage) and which later stages and program outputs read each of its outputs: what a
pipeline sends and keeps.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.split_module import split_module

from ..errors import InternalError, InvalidArgument, InvalidType

SYM_SIZE = torch.ops.aten.sym_size.int


def cuts_for(stages, blocks: int) -> list[int]:
    """The first block of each stage after the first, from ``stages=N`` (blocks spread evenly) or a
    list of those first blocks; a named error otherwise."""
    if isinstance(stages, bool) or not isinstance(stages, (int, list, tuple)):
        raise InvalidType(f"stages= takes a number of stages or a list of the blocks that start stages 1, 2, ..., "
                          f"not {stages!r}")
    if isinstance(stages, int):
        if not 1 <= stages <= blocks:
            raise InvalidArgument(f"stages={stages}: a model of {blocks} blocks splits into 1 to {blocks} stages")
        return [round(k * blocks / stages) for k in range(1, stages)]
    cuts = list(stages)
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in cuts) or cuts != sorted(set(cuts)) \
            or (cuts and not 0 < cuts[0] <= cuts[-1] < blocks):
        raise InvalidArgument(f"stages={cuts}: give the first block of each stage after the first, increasing, within "
                              f"1 to {blocks - 1} (e.g. stages=[{blocks // 2}] splits at block {blocks // 2})")
    return cuts


@dataclass
class Plan:
    """The stages of a program and what flows between them."""

    modules: list[GraphModule]
    # per stage, per input: ("input", program input index) or ("stage", stage, output index)
    inputs: list[list[tuple]] = field(default_factory=list)
    # per stage, per output: the later stages that read it
    readers: list[list[list[int]]] = field(default_factory=list)
    # per program output: ("input", index) or ("stage", stage, output index)
    outputs: list[tuple] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.modules)

    def owner(self, position: int) -> int | None:
        """The stage that computes program output ``position`` (None: it is a program input)."""
        source = self.outputs[position]
        return source[1] if source[0] == "stage" else None


def pick(produced, index):
    """Output ``index`` of what a stage returned (None: the stage returns one value, bare)."""
    return produced if index is None else produced[index]


def split(module: GraphModule, block_of, cuts: list[int]) -> Plan:
    """Cut ``module`` (a built program, left as it is) into ``len(cuts) + 1`` stages; ``block_of(node)`` is
    the block a node's scope names (None outside the blocks)."""
    def stage_of(node: Node) -> int | None:
        block = block_of(node)
        return None if block is None else sum(block >= cut for cut in cuts)
    return split_by(module, stage_of, len(cuts) + 1)


def split_by(module: GraphModule, stage_of, count: int) -> Plan:
    """Cut ``module`` (left as it is) into ``count`` stages; ``stage_of(node)`` is the stage a node's scope
    puts it in, or None for a node that goes with its inputs (or, reading program inputs only, with its
    first reader). ``stage_of`` is asked about ``module``'s own nodes."""
    graph = torch.fx.Graph()
    copies: dict[Node, Node] = {}
    graph.output(graph.graph_copy(module.graph, copies))
    module = GraphModule(module, graph)  # the same attributes and submodules, a graph of its own
    original = {copy: node for node, copy in copies.items()}
    stage: dict[Node, int] = {}
    free: list[Node] = []
    sizes: list[Node] = []
    for node in module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.target is SYM_SIZE and node.args[0].op == "placeholder":
            sizes.append(node)
            continue
        own = stage_of(original[node])
        inputs = [stage[n] for n in node.all_input_nodes if n in stage]
        if own is None and not inputs:  # reads program inputs only (or other such nodes)
            free.append(node)
            continue
        stage[node] = max(inputs + ([own] if own is not None else []))
    for node in reversed(free):  # at its first reader (its free readers come later, so are placed)
        readers = [stage[user] for user in node.users if user in stage]
        if not readers:  # a check on a parameter: where the parameter is read
            readers = [stage[user] for source in node.all_input_nodes for user in source.users if user in stage]
        stage[node] = min(readers, default=0)
    for node in sizes:
        _size_in_each_stage(graph, node, stage)
    split_gm = split_module(module, module, lambda node: stage[node])
    return _plan(split_gm, count)


def _size_in_each_stage(graph: torch.fx.Graph, node: Node, stage: dict[Node, int]) -> None:
    """Give each stage that reads the size ``node`` its own copy of it (in the first, the node itself)."""
    readers: dict[int, list[Node]] = {}
    for user in node.users:
        if user in stage:
            readers.setdefault(stage[user], []).append(user)
    first, *others = sorted(readers) or [0]
    stage[node] = first
    for index in others:
        with graph.inserting_after(node):
            copy = graph.node_copy(node)
        for user in readers[index]:
            user.replace_input_with(node, copy)
        stage[copy] = index


def _plan(split_gm: GraphModule, count: int) -> Plan:
    placeholders = {node: i for i, node in enumerate(split_gm.graph.find_nodes(op="placeholder"))}
    calls = {node: int(node.target.removeprefix("submod_"))  # split_module names them submod_{i}
             for node in split_gm.graph.find_nodes(op="call_module")}
    plan = Plan(modules=[None] * count, inputs=[[] for _ in range(count)], readers=[[] for _ in range(count)])

    def source(node: Node) -> tuple:
        if node in placeholders:
            return ("input", placeholders[node])
        if node in calls:
            return ("stage", calls[node], None)  # a stage with one output returns it bare
        if node.target is operator.getitem and node.args[0] in calls:
            return ("stage", calls[node.args[0]], node.args[1])
        raise InternalError(f"split: unexpected node {node.format_node()} between stages")

    for node, index in calls.items():
        module = split_gm.get_submodule(node.target)
        plan.modules[index] = module
        outputs = module.graph.output_node().args[0]
        plan.readers[index] = [[] for _ in (outputs if isinstance(outputs, (tuple, list)) else [outputs])]
        plan.inputs[index] = [source(arg) for arg in node.args]
    for index in range(count):
        if plan.modules[index] is None:
            raise InvalidArgument(f"stage {index} holds no computation: put fewer stages or cut elsewhere")
        for kind, *where in plan.inputs[index]:
            if kind == "stage":
                plan.readers[where[0]][where[1] or 0].append(index)
    plan.outputs = [source(node) for node in split_gm.graph.output_node().args[0]]
    return plan
