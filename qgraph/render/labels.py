"""The labels of a block's boxes: a module with its shape, a run of ops as a chain, the mixer's core
with a port per argument and output, the rotary, a split with the value each output becomes, and
side operands written as numbers, parameter expressions or context inputs."""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from ..compat import op_argument_names
from .diagram import Box, bold, esc, port_table, small
from .graph import SDPA, SHAPE_ONLY, is_pass_through, is_tensorish, op_name, short_class, tensor_inputs
from .grouping import MULTI_OUTPUT, is_core
from .host import BlockHost
from .skeleton import located

aten = torch.ops.aten

SYMBOL = {aten.add.Tensor: "+", aten.sub.Tensor: "−", aten.mul.Tensor: "×", aten.div.Tensor: "÷"}
_CORE_OUTPUTS = {"chunk_gated_delta_rule": ("output", "final_state"),
                 "chunk_gated_delta_rule_states": ("output", "states", "final_state"),
                 "recurrent_gated_delta_rule": ("output", "final_state")}
_SINGULAR = {"queries": "query", "keys": "key", "values": "value"}
_CORE_TITLE = {"scaled_dot_product_attention": "attention", "chunk_gated_delta_rule": "gated delta rule",
               "recurrent_gated_delta_rule": "gated delta rule", "chunk_gated_delta_rule_states": "gated delta rule",
               "varlen_attention": "attention, per image"}


class BlockLabels(BlockHost):
    """The boxes of a block's groups (mixed into the block diagram, which holds the groups)."""

    def _box(self, key, nodes, box_id) -> Box | None:
        view, kind = self.view, key[0]
        if kind == "in":
            if key[1] == "residual":
                source = small(f"from {self._source_name(self.residual_in)}", 9, "#DDDDDD")
                label = bold("residual stream") + "<BR/>" + source
                return Box(box_id, label, "stream", None, "the residual stream entering the block")
            rotary = next((s for n in self.nodes for u in n.all_input_nodes if u not in self.inside
                           for s in view.scopes(u) if "rotary" in s), "rotary_emb")
            text = {"position": ("position embeddings", f"{rotary}: cos, sin"),
                    "mask": ("attention mask", "built from attention_mask")}.get(key[1], (key[1], ""))
            return Box(box_id, esc(text[0]) + ("<BR/>" + small(text[1]) if text[1] else ""), "context", None, text[0])
        if kind == "out":
            return Box(box_id, bold("residual stream") + "<BR/>" + small(f"to {key[1]}", 9, "#DDDDDD"), "stream", None,
                       "the residual stream leaving the block")
        if kind == "param":
            node = next(n for n in view.graph.nodes if n.name == key[1])
            reader = next((u for u in node.users if u in self.inside), None)
            cluster = self._cluster_of(view.scope(reader)) if reader is not None else None
            name = view.param_name(node)
            return Box(box_id, small(name.rsplit(".", 1)[-1], 9, "#333333") + "<BR/>" + small(view.shape_text(node), 8),
                       "param", cluster, name)
        if self.detail == "ops":
            node = nodes[0]
            label = bold(op_name(node)) + " " + small(node.name, 8, "#777777")
            shape = view.shape_text(node)
            if shape:
                label += "<BR/>" + small(shape, 8)
            box_kind = "op_hidden" if not is_tensorish(node) else (
                "core" if is_core(node) else "op")
            return Box(box_id, label, box_kind, self._cluster_of(view.scope(node)), str(node.format_node()))
        if kind == "module":
            return self._module_box(key[1], nodes, box_id)
        return self._op_box(nodes, box_id)

    def _source_name(self, node: Node) -> str:
        """The module a tensor from outside the block comes from (through the model's own code)."""
        frontier, seen = [node], set()
        while frontier:
            current = frontier.pop(0)
            if current in seen:
                continue
            seen.add(current)
            scopes = self.view.scopes(current)
            if scopes:
                return scopes[0]
            frontier.extend(current.all_input_nodes)
        return "the model's inputs"

    def _module_box(self, scope: str, nodes, box_id) -> Box:
        view = self.view
        cluster = self._cluster_of(scope.rpartition(".")[0])
        relative = scope[len(cluster) + 1:] if cluster else scope
        type_name = short_class(view.types.get(scope, ""))
        detail = type_name
        linear = next((n for n in nodes if n.target is aten.linear.default), None)
        if linear is not None and len(linear.args) > 1 and isinstance(linear.args[1], Node):
            out_features, in_features = linear.args[1].meta["val"].shape[:2]
            detail = f"{type_name} {in_features} → {out_features}"
        elif "RMSNorm" in type_name:
            one_plus = any(n.target is aten.add.Tensor and 1.0 in n.args and self.const.get(n) for n in nodes)
            gated = any(n.target is aten.silu.default for n in nodes)
            detail = (type_name + ("  ·  gain 1 + w" if one_plus else "  ·  gain w")
                      + ("  ·  × silu(gate)" if gated else ""))
        activation = "Activation" in type_name or "act" in relative
        kind = "norm" if "Norm" in type_name else ("act" if activation else "module")
        tooltip = f"{scope} ({view.types.get(scope, '')})"
        return Box(box_id, bold(relative) + "<BR/>" + small(detail), kind, cluster, tooltip)

    def _op_box(self, nodes, box_id) -> Box:
        view = self.view
        nodes = sorted(nodes, key=view.index.__getitem__)
        head = nodes[0]
        cluster = self._cluster_of(view.scope(head))
        tooltip = "\n".join(n.format_node() for n in nodes)
        core = next((n for n in nodes if is_core(n)), None)
        if core is not None:
            name = op_name(core)
            sub = f"{getattr(core.target, 'namespace', 'aten')}::{name}"
            if core.target is SDPA and core.kwargs.get("scale"):
                sub += f"  ·  scale {core.kwargs['scale']:.4g}"
            schema = op_argument_names(core.target)
            inputs = [(f"i{i}", schema[i]) for i, arg in enumerate(core.args)
                      if isinstance(arg, Node) and i < len(schema)]
            outputs = [(f"o{j}", text) for j, text in enumerate(_CORE_OUTPUTS.get(name, ()))]
            body = bold(_CORE_TITLE.get(name, name)) + "<BR/>" + small(sub)
            return Box(box_id, port_table(body, inputs, outputs, "#F3EEFF"), "core", cluster, tooltip,
                       {"ports": core})
        if head in self.rotary:
            return Box(box_id, bold("rotary") + "<BR/>" + small(self._rotary_detail(nodes)), "rotary", cluster, tooltip)
        if head.target in MULTI_OUTPUT:
            outputs = [(f"o{j}", self._output_name(head, j)) for j in range(len(head.meta["val"]))]
            body = esc(self._op_label(head, True) + (" per head" if head.args[0].meta["val"].dim() == 4 else ""))
            return Box(box_id, port_table(body, (), outputs, "#FFFFFF"), "split", cluster, tooltip, {"ports": head})
        if len(nodes) == 1 and head.target in SYMBOL and len(self._activation_groups(head)) == 2:
            return Box(box_id, esc(SYMBOL[head.target]), "sum" if head.target is aten.add.Tensor else "product",
                       cluster, tooltip)
        parts = [p for p in (self._op_label(n, i == 0) for i, n in enumerate(nodes)) if p]
        label = esc("  →  ".join(parts) or op_name(head))
        return Box(box_id, label, "op", cluster, tooltip)

    def _activation_groups(self, node: Node) -> set:
        """The boxes whose tensors ``node`` combines (the position embeddings and masks not counted)."""
        groups = set()
        for u in tensor_inputs(node):
            root = self._root(u)
            if self._context_kind(root):
                continue
            groups.add(self._group_of(root))
        return groups - {None}

    def _output_name(self, head: Node, index: int) -> str:
        """What output ``index`` of a split becomes: the first standard value downstream (query, gate)."""
        item = next((u for u in head.users if u.target is operator.getitem and u.args[1] == index), None)
        located_at = {located(entry): name for name, entry in self.values.items()
                      if entry.spec is not None and located(entry) is not None}
        frontier, seen = [item] if item is not None else [], set()
        while frontier:
            node = frontier.pop(0)
            if node in seen or node not in self.inside:
                continue
            seen.add(node)
            if node in located_at:
                short = located_at[node].rsplit(".", 1)[-1].removeprefix("attention_")
                return _SINGULAR.get(short, short)
            frontier.extend(node.users)
        return f"[{index}]"

    def _port(self, flow, side: str) -> str | None:
        """The port of a core or split box a wire meets: the argument it is, or the output it leaves by."""
        key = flow.dst if side == "head" else flow.origin
        box_id = self._ids.get(key) if isinstance(key, tuple) else None
        box = self.diagram.boxes.get(box_id) if box_id is not None else None
        head = box.attrs.get("ports") if box is not None else None
        if head is None:
            return None
        if side == "head":
            index = next((i for i, arg in enumerate(head.args) if arg is flow.via), None)
            return f"i{index}:n" if index is not None else None
        node = flow.via
        while isinstance(node, Node) and node in self.inside:
            if node.target is operator.getitem and node.args[0] is head:
                return f"o{node.args[1]}:s"
            node = node.args[0] if node.args and isinstance(node.args[0], Node) else None
        return None

    def _rotary_detail(self, nodes) -> str:
        for node in nodes:
            if node.target is aten.slice.Tensor and node.args[2] in (0, None):
                width = node.args[0].meta["val"].shape[node.args[1]]
                rotated = node.args[3]
                if isinstance(rotated, int) and rotated < width:
                    return f"turns dims 0–{rotated} of {width}"
        return "cos, sin"

    def _op_label(self, node: Node, first: bool) -> str:
        target = node.target
        if target is aten.slice.Tensor:
            start = node.args[2] if len(node.args) > 2 else None
            end = node.args[3] if len(node.args) > 3 else None
            return "" if not first else f"slice {'' if start is None else start}:{'' if end is None else end}"
        if target in SYMBOL:
            operands = [self._operand(a) for a in node.args]
            side = [o for o in operands if o is not None]
            return f"{SYMBOL[target]} {side[0]}" if side else SYMBOL[target]
        if target is aten.conv1d.default:
            weight = node.args[1].meta["val"].shape
            groups = node.args[6] if len(node.args) > 6 else 1
            return f"conv1d (width {weight[-1]}{', depthwise' if groups == weight[0] and groups > 1 else ''})"
        if target is aten.split_with_sizes.default:
            return f"split {list(node.args[1])}"
        if target in (aten.chunk.default, aten.split.Tensor):
            return f"split in {node.args[1]}" if target is aten.chunk.default else "split"
        if target in SHAPE_ONLY:
            return {"new_zeros": "zeros", "zeros_like": "zeros"}.get(op_name(node), op_name(node))
        return op_name(node)

    def _operand(self, arg) -> str | None:
        """How a side operand reads in a label: a number, a parameter expression, a context input."""
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            return f"{arg:.4g}"
        if not isinstance(arg, Node):
            return None
        root = self._root(arg)
        if root in self.inside and self.const.get(root):
            return self._const_expr(root)
        if root not in self.inside and self.view.is_param(root):
            return self.view.param_name(root).rsplit(".", 1)[-1]
        kind = self._context_kind(root)
        return {"mask": "attention mask", "position": "cos/sin"}.get(kind, kind) if kind else None

    def _const_expr(self, node: Node) -> str:
        """``neg(exp(A_log))`` -> ``−exp(A_log)``: a parameter-only computation, as an expression."""
        if self.view.is_param(node):
            return self.view.param_name(node).rsplit(".", 1)[-1]
        if not isinstance(node, Node) or not node.args:
            return "?"
        inner = node.args[0]
        inner_text = self._const_expr(inner) if isinstance(inner, Node) else str(inner)
        if is_pass_through(node):
            return inner_text
        if node.target is aten.neg.default:
            return f"−{inner_text}"
        if node.target in SYMBOL and len(node.args) > 1:
            other = node.args[1]
            other_text = self._const_expr(other) if isinstance(other, Node) else f"{other:.4g}"
            return f"({inner_text} {SYMBOL[node.target]} {other_text})"
        return f"{op_name(node)}({inner_text})"
