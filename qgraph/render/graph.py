"""Reading an exported graph for drawing: module scopes, what each node does, where each value sits.

``GraphView`` draws the program builder's graph (``qgraph.program.Program``, with the on-request
values asked for made and the port markers still in place, so module ports and scopes are there),
and answers the questions the diagrams ask:
which module scope a node runs in, whether it only re-views a tensor, whether it is computed from
parameters alone, and what a node outside a block feeds into it.
"""
from __future__ import annotations

import operator
import re
import torch
from torch.fx import Graph, Node

from ..export import ExportedModel
from ..kernels.ops import DELTA_RULE_OPS, MARK_OP
from ..program import Program

aten = torch.ops.aten

# Ops that only re-view, re-lay, re-type or pick an output of a tensor: drawn as a wire, not a box.
PASS_THROUGH = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.contiguous.default, aten.clone.default, aten.to.dtype, aten.to.device,
    aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default, aten.dropout.default,
    aten.alias.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.expand.default, aten.flatten.using_ints, aten.unflatten.int, aten.detach.default,
    aten.lift_fresh_copy.default, aten.repeat_interleave.self_int, operator.getitem, MARK_OP,
}
# Ops that read only their input's shape, dtype and device (``new_zeros``): no data flows in.
SHAPE_ONLY = {
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
}
SDPA = aten.scaled_dot_product_attention.default
_FULL = 2 ** 62


def is_full_slice(node: Node) -> bool:
    """``x[:, :]``-style slices that keep every element (export writes them for plain indexing)."""
    if node.target is not aten.slice.Tensor:
        return False
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    return start in (None, 0) and (end is None or (isinstance(end, int) and end >= _FULL)) and step == 1


def is_pass_through(node: Node) -> bool:
    return node.op == "call_function" and (node.target in PASS_THROUGH or is_full_slice(node))


def is_tensorish(node: Node) -> bool:
    """A node whose value is a tensor or a sequence of tensors (what can flow along a wire)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val)


def tensor_inputs(node: Node) -> list[Node]:
    """The nodes whose tensors ``node`` reads (shape-only reads and size arguments excluded)."""
    if node.target in SHAPE_ONLY:
        return []
    found = []
    for arg in (*node.args, *node.kwargs.values()):
        for item in (arg if isinstance(arg, (list, tuple)) else (arg,)):
            if isinstance(item, Node) and is_tensorish(item) and item not in found:
                found.append(item)
    return found


def op_name(node: Node) -> str:
    """``aten.linear.default`` -> ``linear``; ``qgraph.chunk_gated_delta_rule.default`` ->
    ``chunk_gated_delta_rule``."""
    target = node.target
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return packet.__name__.split(".")[-1]
    return getattr(target, "__name__", str(target)).split(".")[-1]


def short_class(type_name: str) -> str:
    """``transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5RMSNorm`` -> ``RMSNorm``."""
    name = type_name.rsplit(".", 1)[-1]
    return re.sub(r"^Qwen\d+(_\d+)?(VL)?", "", name) or name


class GraphView:
    """The exported graph of one model, with markers, scopes and located values, ready to draw."""

    def __init__(self, model, exported: ExportedModel, *, requested=(), saes=None, transcoders=None):
        self.model, self.exported, self.family = model, exported, exported.family
        self.config = model.config
        # the values a pass makes when asked for (a block's pattern under sdpa, the DeltaNet's states, its
        # conv context) are made by the program builder, so the picture shows the program that runs
        program = Program(model, exported, saes=saes, transcoders=transcoders).make(requested)
        self.graph: Graph = program.graph
        self.catalogue, self.locator = program.catalogue, program.locator
        for node in self.graph.nodes:  # an output read the locator added runs where its op runs
            if (node.target is operator.getitem and "nn_module_stack" not in node.meta
                    and isinstance(node.args[0], Node)):
                if "nn_module_stack" in node.args[0].meta:
                    node.meta["nn_module_stack"] = node.args[0].meta["nn_module_stack"]

        self.index = {node: i for i, node in enumerate(self.graph.nodes)}
        self.params: dict[str, str] = {}  # placeholder name -> the parameter's spec name ("layers.0.linear_attn.A_log")
        self.inputs: set[str] = set()  # the user inputs: input_ids, attention_mask
        for spec in exported.program.graph_signature.input_specs:
            name = getattr(spec.arg, "name", None)
            if name is None:  # every input export writes has a name; a spec without one is no input to draw
                continue
            if spec.target is not None:
                module, _, attribute = spec.target.rpartition(".")
                self.params[name] = ".".join(p for p in (self.family.module_name(module), attribute) if p)
            else:
                self.inputs.add(name)
        self.types: dict[str, str] = {}  # spec name -> class name
        self._scopes: dict[Node, list[str]] = {}
        for node in self.graph.nodes:
            names = []
            for path, type_name in (node.meta.get("nn_module_stack") or {}).values():
                name = self.family.module_name(path)
                if name and not name.startswith("_empty_nn_module_stack"):  # export's placeholder scope
                    names.append(name)
                    self.types.setdefault(name, type_name if isinstance(type_name, str) else
                                          getattr(type_name, "__qualname__", str(type_name)))
            self._scopes[node] = names
        self.block_mixers = self.family.block_mixers(self.config)
        batch, seq = self.graph.find_nodes(op="placeholder", target="input_ids")[0].meta["val"].shape
        self._symbols = {str(batch): "batch", str(seq): "seq"}

    # -- scopes ----------------------------------------------------------------------------------
    def scopes(self, node: Node) -> list[str]:
        """The spec names of the modules ``node`` runs in, outermost first."""
        return self._scopes.get(node, [])

    def scope(self, node: Node) -> str:
        """The innermost module ``node`` runs in ("" for the model's own code)."""
        names = self._scopes.get(node)
        return names[-1] if names else ""

    def in_scope(self, node: Node, module: str) -> bool:
        return module in self._scopes.get(node, ())

    # -- values ----------------------------------------------------------------------------------
    def location(self, name: str):
        return self.catalogue[name].location

    def is_param(self, node: Node) -> bool:
        return node.op in ("placeholder", "get_attr") and node.name not in self.inputs

    def param_name(self, node: Node) -> str:
        return self.params.get(node.name, node.name)

    def shape_text(self, node: Node) -> str:
        """``[batch seq 256]`` for a node's tensor (or the first tensor of its outputs)."""
        val = node.meta.get("val")
        if isinstance(val, (list, tuple)):
            val = next((v for v in val if isinstance(v, torch.Tensor)), None)
        if not isinstance(val, torch.Tensor):
            return ""
        sizes = [re.sub(r"\bs\d+\b", lambda m: self._symbols.get(m.group(0), m.group(0)), str(s)) for s in val.shape]
        return "[" + " ".join(sizes) + "]"

    def streams(self, node: Node) -> int:
        """How many residual streams ``node``'s tensor holds side by side: the family's ``streams`` dim (a
        residual stream that hyper-connections make several wide) when its last axis is that many hidden
        sizes, or its last two are the streams and the hidden size; else 1."""
        streams, hidden = self.family.dim(self.config, "streams"), self.family.dim(self.config, "hidden_size")
        value = node.meta.get("val")
        if not streams or not hidden or not isinstance(value, torch.Tensor) or not value.dim():
            return 1
        tail = [size if isinstance(size, int) else None for size in value.shape[-2:]]
        return streams if tail[-1] == streams * hidden or tail == [streams, hidden] else 1

    def is_delta_rule(self, node: Node) -> bool:
        return node.target in DELTA_RULE_OPS

    def ancestors_inputs(self, node: Node, limit: int = 400) -> set[str]:
        """The user inputs (``input_ids``, ``attention_mask``) that ``node`` is computed from."""
        seen: set[Node] = set()
        stack, found = [node], set()
        while stack and len(seen) < limit:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            if current.op == "placeholder" and current.name in self.inputs:
                found.add(current.name)
            stack.extend(n for n in current.all_input_nodes if n not in seen)
        return found
