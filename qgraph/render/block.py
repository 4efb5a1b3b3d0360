"""One block drawn from the exported graph: its modules, the ops between them, and every value on it.

Two levels of detail share one method: each graph node of the block is put in a group (a drawn
box), wires are the tensors read between groups, and each value's node becomes a tap point spliced
into the wires that carry it.

* ``detail="modules"``: a leaf module (``q_proj``, ``q_norm``, ``act_fn``) is one box; the code
  between modules keeps only what computes (re-views, casts and markers are wires), elementwise
  runs fuse into one box (``+ dt_bias → softplus → × −exp(A_log)``), the rotary's slices and
  rotations fuse into one box, and parameters feed the labels, not boxes.
* ``detail="ops"``: every graph node of the block is a box, in nested clusters by module scope.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch.fx import Node

from ..ops import MARK_OP
from ..passes.locate import attention_core
from .diagram import Box, Cluster, Diagram, bold, esc, port_table, small
from .flow import build_flows, splice_taps
from .graph import SDPA, SHAPE_ONLY, GraphView, is_pass_through, is_tensorish, op_name, short_class, tensor_inputs

aten = torch.ops.aten

MIXER_KIND = {"linear_attn": "gated DeltaNet", "self_attn": "gated attention"}
# elementwise ops that may join the box of the op before them (one input from it, its only reader)
_FUSABLE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default, aten.exp.default,
    aten.log.default, aten.sigmoid.default, aten.silu.default, aten.softplus.default, aten.tanh.default,
    aten.gelu.default, aten.relu.default, aten.slice.Tensor, aten.pow.Tensor_Scalar, aten.rsqrt.default,
    aten.where.self, aten.where.ScalarOther, aten.masked_fill.Scalar,
}
_ROTARY_OPS = {aten.slice.Tensor, aten.neg.default, aten.cat.default, aten.mul.Tensor, aten.add.Tensor}
_MULTI_OUTPUT = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int}
_SYMBOL = {aten.add.Tensor: "+", aten.sub.Tensor: "−", aten.mul.Tensor: "×", aten.div.Tensor: "÷"}
_CORE_OUTPUTS = {"chunk_gated_delta_rule": ("output", "final_state"),
                 "chunk_gated_delta_rule_states": ("output", "states", "final_state"),
                 "recurrent_gated_delta_rule": ("output", "final_state")}
_SINGULAR = {"queries": "query", "keys": "key", "values": "value"}
_CORE_TITLE = {"scaled_dot_product_attention": "attention", "chunk_gated_delta_rule": "gated delta rule",
               "recurrent_gated_delta_rule": "gated delta rule", "chunk_gated_delta_rule_states": "gated delta rule",
               "varlen_attention": "attention, per image"}


def block_diagram(view: GraphView, layer: int, *, detail: str = "modules",
                  highlight: dict[str, str] | None = None, vision: bool = False) -> Diagram:
    """The diagram of block ``layer`` (of the vision tower with ``vision``); ``highlight`` maps value
    names to "value" (instrumented) or "edit"."""
    return _Block(view, layer, highlight or {}, detail, vision).diagram


def is_core(node: Node) -> bool:
    """The op a mixer is built around: sdpa, or one of qgraph's kernels (delta rule, packed vision attention)."""
    if node.target is SDPA:
        return True
    namespace = getattr(node.target, "namespace", None)
    return namespace == "qgraph" and node.target is not MARK_OP


class _Block:
    """Groups one block's nodes into boxes, wires them, splices the values in, and draws the result."""

    def __init__(self, view: GraphView, layer: int, highlight: dict[str, str], detail: str, vision: bool = False):
        self.view, self.layer, self.highlight, self.detail, self.vision = view, layer, highlight, detail, vision
        self.prefix = f"vision.layers.{layer}" if vision else f"layers.{layer}"
        self.mixer = "self_attn" if vision else view.block_mixers[layer]
        self.nodes = [n for n in view.graph.nodes if view.in_scope(n, self.prefix)]
        self.inside = set(self.nodes)
        scopes = {s for n in self.nodes for s in view.scopes(n) if s == self.prefix or s.startswith(self.prefix + ".")}
        self.leaves = {s for s in scopes if s != self.prefix and not any(o.startswith(s + ".") for o in scopes)}
        self.scopes = scopes
        self.residual_in = self._residual_source()
        self.values = self._values()

        self.groups: dict[Node, object] = {}
        # modules detail: each node's kind, whether it is computed from parameters alone, the rotary's
        # nodes, and what is computed from a mask or the position embeddings alone
        self.kinds, self.const, self.rotary, self.context, self.value_roots = {}, {}, set(), {}, set()
        if detail == "ops":
            self._group_ops()
        else:
            self._group_modules()
        flows = build_flows(self.nodes, self.groups.get, self._outside_group, self._sink)
        taps = self._tap_list()
        flows = splice_taps(flows, taps, self._absorbed)
        self.diagram = Diagram(self._title())
        self._draw(flows)

    # -- what is in the block ------------------------------------------------------------------
    def _residual_source(self) -> Node | None:
        marker = self.view.locator.ports.get(f"{self.prefix}.input")
        return marker.args[0] if marker is not None else None

    def _values(self) -> dict[str, object]:
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
        while node in self.inside and self._absorbed(node):
            node = node.args[0]
        return node

    # -- grouping --------------------------------------------------------------------------------
    def _group_ops(self):
        for node in self.nodes:
            if node.target is MARK_OP:
                continue
            self.groups[node] = ("op", node.name)
        for node in self.nodes:
            if node.target is MARK_OP:
                root = self._root(node)
                self.groups[node] = self.groups.get(root) if root in self.inside else self._outside_group(root)

    def _group_modules(self):
        view = self.view
        const = {}
        kinds = {}
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
        self.kinds, self.const = kinds, const
        # what the block computes from a mask or the position embeddings alone is part of that input
        for node in self.nodes:
            if kinds[node] == "compute" and not const[node]:
                roots = [self._root(u) for u in tensor_inputs(node)]
                sides = [self._context_kind(r) for r in roots if not self._is_const(r)]
                if sides and all(sides):
                    self.context[node] = sides[0]

        parent = {}  # union-find over compute nodes

        def find(node):
            while parent[node] is not node:
                parent[node] = parent[parent[node]]
                node = parent[node]
            return node

        def union(a, b):
            ra, rb = find(a), find(b)
            if ra is not rb:
                if view.index[rb] < view.index[ra]:
                    ra, rb = rb, ra
                parent[rb] = ra

        compute = [n for n in self.nodes if kinds[n] == "compute" and not const[n] and n not in self.context]
        for node in compute:
            parent[node] = node
        self.value_roots = {self._root(entry.location.node) for entry in self.values.values()
                            if hasattr(entry.location, "node") and type(entry.location).__name__ == "Found"}

        # the rotary: slices, rotations and products that read the position embeddings, one box per use
        self.rotary = set()
        seeds = [n for n in compute if n.target in _ROTARY_OPS and any(
            self._context_kind(self._root(u)) == "position" for u in tensor_inputs(n))]
        for seed in seeds:
            if seed in self.rotary:
                continue
            region, stack = {seed}, [seed]
            while stack:
                current = stack.pop()
                neighbours = [self._root(u) for u in tensor_inputs(current)] + [
                    u for d in self._carriers(current) for u in d.users]
                for other in neighbours:
                    if (other in parent and other not in region and other.target in _ROTARY_OPS
                            and view.scope(other) == view.scope(seed)):
                        region.add(other)
                        stack.append(other)
            for node in region:
                union(seed, node)
            self.rotary |= region

        # elementwise runs: fuse an op into the box before it when that box feeds only it
        for node in compute:
            if node in self.rotary or node.target not in _FUSABLE:
                continue
            sources = {find(r) for r in (self._root(u) for u in tensor_inputs(node)) if r in parent}
            others = [r for r in (self._root(u) for u in tensor_inputs(node))
                      if r not in parent and not self._context_kind(r) and not self._is_const(r)]
            if len(sources) != 1 or others:
                continue
            head = next(iter(sources))
            members = [n for n in compute if find(n) is head]
            if (head in self.rotary or head.target in _MULTI_OUTPUT or is_core(head)
                    or any(m in self.value_roots for m in members) or view.scope(head) != view.scope(node)):
                continue
            readers = {u for m in members for d in self._carriers(m) for u in d.users
                       if not self._absorbed(u) and is_tensorish(u) and u.target not in SHAPE_ONLY}
            if readers - set(members) == {node}:
                union(head, node)

        for node in self.nodes:
            kind = kinds[node]
            if kind == "module":
                self.groups[node] = ("module", view.scope(node))
            elif kind == "compute" and node in self.context:
                self.groups[node] = ("in", self.context[node])
            elif kind == "compute" and not const[node]:
                self.groups[node] = ("op", find(node).name)
        for node in self.nodes:
            if kinds[node] == "pass":
                root = self._root(node)
                self.groups[node] = self.groups.get(root) if root in self.inside else self._outside_group(root)

    def _carriers(self, node: Node) -> list[Node]:
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

    def _sink(self, user: Node):
        if user.op == "output":
            return ("out", "output")
        if not is_tensorish(user) and user.target is not MARK_OP:
            return None
        scope = self.view.scopes(user)
        return ("out", scope[0] if scope else "the model")

    # -- taps ------------------------------------------------------------------------------------
    def _tap_list(self):
        by_node = defaultdict(list)
        self.ghosts = []
        for name, entry in self.values.items():
            location = entry.location
            if type(location).__name__ == "Found" and self.groups.get(location.node) is not None:
                by_node[location.node].append(name)
            elif type(location).__name__ == "Found" and location.node is self.residual_in:
                by_node[location.node].append(name)
            else:
                self.ghosts.append(name)
        self.tap_ids = {}
        taps = []
        for node in sorted(by_node, key=self.view.index.get):
            tap_id = f"t{len(self.tap_ids)}"
            self.tap_ids[tap_id] = by_node[node]
            origin = self.groups.get(node) if node in self.inside else self._outside_group(node)
            taps.append((node, tap_id, origin))
        self.tap_nodes = {tap_id: node for node, tap_id, _ in taps}
        return taps

    # -- drawing ---------------------------------------------------------------------------------
    def _title(self) -> str:
        model = type(self.view.model).__name__
        if self.vision:
            return f"{self.prefix}  ·  vision encoder block  ·  {model}  ·  detail={self.detail}"
        kind = MIXER_KIND.get(self.mixer, self.mixer)
        layer_type = self.view.config.get_text_config().layer_types[self.layer]
        return f"{self.prefix}  ·  {kind} block ({layer_type})  ·  {model}  ·  detail={self.detail}"

    def _cluster_of(self, scope: str) -> str | None:
        """The drawn cluster a box of ``scope`` sits in: the scope itself or its nearest drawn parent."""
        while scope and scope not in self.diagram.clusters:
            scope = scope.rpartition(".")[0]
        return scope or None

    def _draw(self, flows):
        d, view = self.diagram, self.view
        # clusters: the block, and its modules that hold others (ops: every module)
        cluster_scopes = sorted(self.scopes if self.detail == "ops" else
                                {s for s in self.scopes if s not in self.leaves}, key=lambda s: (s.count("."), s))
        for scope in cluster_scopes:
            parent = scope.rpartition(".")[0]
            parent = parent if parent in d.clusters else None
            type_name = short_class(view.types.get(scope, ""))
            relative = scope[len(parent) + 1:] if parent else scope
            if scope == self.prefix:
                kind, label = "block", f"{scope}  ·  {view.types.get(scope, '').rsplit('.', 1)[-1]}"
            elif scope == f"{self.prefix}.{self.mixer}":
                what = "attention" if self.vision else MIXER_KIND.get(relative, "")
                kind, label = "mixer_" + self.mixer, f"{relative}  ·  {what}  ·  {type_name}"
            elif scope.endswith(".mlp"):
                kind, label = "mlp", f"{relative}  ·  {type_name}"
            else:
                kind, label = "scope", f"{relative}  ·  {type_name}"
            d.clusters[scope] = Cluster(scope, label, kind, parent)

        ids = self._ids = {}

        def box_id(key):
            if key not in ids:
                ids[key] = f"{'g' if key[0] in ('op', 'module', 'param') else key[0][0]}{len(ids)}"
            return ids[key]

        members = defaultdict(list)
        for node, key in self.groups.items():
            if key is not None and key[0] in ("op", "module") and (self.detail == "ops" or self.kinds.get(node) != "pass"):
                members[key].append(node)
        keys = set(members) | {f.src for f in flows if isinstance(f.src, tuple)} | {f.dst for f in flows if isinstance(f.dst, tuple)}
        order = lambda key: (min((view.index[n] for n in members.get(key, ())), default=-1 if key[0] == "in" else 10 ** 9))
        spine = self._spine(flows)
        for key in sorted(keys, key=lambda k: (order(k), str(k))):
            box = self._group_box(key, members.get(key, []), box_id(key))
            if box is not None:
                if key in spine:
                    box.attrs["group"] = "spine"
                d.add(box)
        for tap_id, names in self.tap_ids.items():
            d.add(self._tap_box(tap_id, names))
        for tap_id in self._spine_taps:
            d.boxes[tap_id].attrs["group"] = "spine"

        core_of = {}  # the box of each attention core, for the values its fused op hides
        for key, nodes in members.items():
            if any(is_core(n) for n in nodes):
                core_of[key] = box_id(key)
        seen = set()
        for flow in flows:
            src = flow.src if isinstance(flow.src, str) else ids.get(flow.src)
            dst = flow.dst if isinstance(flow.dst, str) else ids.get(flow.dst)
            if src is None or dst is None or src not in d.boxes or dst not in d.boxes or (src, dst) in seen:
                continue
            seen.add((src, dst))
            is_spine = (flow.src in spine or flow.src in self._spine_taps) and (flow.dst in spine or flow.dst in self._spine_taps)
            kind = "spine" if is_spine else ("context" if isinstance(flow.src, tuple) and flow.src[0] == "in"
                                              and flow.src[1] != "residual" else "data")
            ports = {}
            if self.detail == "modules":
                head_port, tail_port = self._port(flow, "head"), self._port(flow, "tail")
                if head_port and not isinstance(flow.dst, str):
                    ports["headport"] = head_port
                if tail_port and not isinstance(flow.src, str):
                    ports["tailport"] = tail_port
            d.connect(src, dst, kind, **ports)
        for name in self.ghosts:
            self._ghost(name, ids)
        # a module sits right under what feeds it (in_proj_z next to in_proj_qkv, not down by the norm)
        fan_in = defaultdict(int)
        for wire in d.wires:
            fan_in[wire.dst] += 1
        for wire in d.wires:
            if d.boxes[wire.dst].kind in ("module", "norm") and wire.kind == "data" and fan_in[wire.dst] == 1:
                wire.attrs.setdefault("weight", "3")
        # a context input (mask, cos/sin) sits next to what reads it
        for wire in d.wires:
            source, target = d.boxes[wire.src], d.boxes[wire.dst]
            if source.kind == "context" and source.cluster is None:
                source.cluster = target.cluster
        self._legend()

    def _spine(self, flows) -> set:
        """The residual stream: what enters, the block's own adds, and what leaves."""
        spine = {("in", "residual")}
        for node in self.nodes:
            if self.groups.get(node) and self.groups[node][0] == "op" and self.view.scope(node) == self.prefix:
                spine.add(self.groups[node])
        spine |= {f.dst for f in flows if isinstance(f.dst, tuple) and f.dst[0] == "out"}
        self._spine_taps = set()
        for tap_id, node in self.tap_nodes.items():
            into = {f.dst for f in flows if f.src == tap_id}
            origin = self.groups.get(node) if node in self.inside else self._outside_group(node)
            if origin in spine and (into & (spine | set(self.tap_ids)) or not into):
                self._spine_taps.add(tap_id)
        # a tap between two spine taps stays on the spine only if it reads from and feeds the spine
        return spine

    def _group_box(self, key, nodes, box_id) -> Box | None:
        view, kind = self.view, key[0]
        if kind == "in":
            if key[1] == "residual":
                label = bold("residual stream") + "<BR/>" + small(f"from {self._source_name(self.residual_in)}", 9, "#DDDDDD")
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
            detail = type_name + ("  ·  gain 1 + w" if one_plus else "  ·  gain w") + ("  ·  × silu(gate)" if gated else "")
        kind = "norm" if "Norm" in type_name else ("act" if "Activation" in type_name or "act" in relative else "module")
        return Box(box_id, bold(relative) + "<BR/>" + small(detail), kind, cluster, f"{scope} ({view.types.get(scope, '')})")

    def _op_box(self, nodes, box_id) -> Box:
        view = self.view
        nodes = sorted(nodes, key=view.index.get)
        head = nodes[0]
        cluster = self._cluster_of(view.scope(head))
        tooltip = "\n".join(n.format_node() for n in nodes)
        core = next((n for n in nodes if is_core(n)), None)
        if core is not None:
            name = op_name(core)
            sub = f"{getattr(core.target, 'namespace', 'aten')}::{name}"
            if core.target is SDPA and core.kwargs.get("scale"):
                sub += f"  ·  scale {core.kwargs['scale']:.4g}"
            schema = core.target._schema.arguments
            inputs = [(f"i{i}", schema[i].name) for i, arg in enumerate(core.args)
                      if isinstance(arg, Node) and i < len(schema)]
            outputs = [(f"o{j}", text) for j, text in enumerate(_CORE_OUTPUTS.get(name, ()))]
            body = bold(_CORE_TITLE.get(name, name)) + "<BR/>" + small(sub)
            return Box(box_id, port_table(body, inputs, outputs, "#F3EEFF"), "core", cluster, tooltip,
                       {"ports": core})
        if head in self.rotary:
            return Box(box_id, bold("rotary") + "<BR/>" + small(self._rotary_detail(nodes)), "rotary", cluster, tooltip)
        if head.target in _MULTI_OUTPUT:
            outputs = [(f"o{j}", self._output_name(head, j)) for j in range(len(head.meta["val"]))]
            body = esc(self._op_label(head, True) + (" per head" if head.args[0].meta["val"].dim() == 4 else ""))
            return Box(box_id, port_table(body, (), outputs, "#FFFFFF"), "split", cluster, tooltip, {"ports": head})
        if len(nodes) == 1 and head.target in _SYMBOL and len(self._activation_groups(head)) == 2:
            return Box(box_id, esc(_SYMBOL[head.target]), "sum" if head.target is aten.add.Tensor else "product",
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
            groups.add(self.groups.get(root) if root in self.inside else self._outside_group(root))
        return groups - {None}

    def _output_name(self, head: Node, index: int) -> str:
        """What output ``index`` of a split becomes: the first standard value downstream (query, gate)."""
        item = next((u for u in head.users if u.target is operator.getitem and u.args[1] == index), None)
        located = {entry.location.node: name for name, entry in self.values.items()
                   if entry.spec is not None and type(entry.location).__name__ == "Found"}
        frontier, seen = [item] if item is not None else [], set()
        while frontier:
            node = frontier.pop(0)
            if node in seen or node not in self.inside:
                continue
            seen.add(node)
            if node in located:
                short = located[node].rsplit(".", 1)[-1].removeprefix("attention_")
                return _SINGULAR.get(short, short)
            frontier.extend(node.users)
        return f"[{index}]"

    def _port(self, flow, side: str) -> str | None:
        """The port of a core or split box a wire meets: the argument it is, or the output it leaves by."""
        key = flow.dst if side == "head" else flow.origin
        box = self.diagram.boxes.get(self._ids.get(key)) if isinstance(key, tuple) else None
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
        if target in _SYMBOL:
            operands = [self._operand(a) for a in node.args]
            side = [o for o in operands if o is not None]
            return f"{_SYMBOL[target]} {side[0]}" if side else _SYMBOL[target]
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
        if node.target in _SYMBOL and len(node.args) > 1:
            other = node.args[1]
            other_text = self._const_expr(other) if isinstance(other, Node) else f"{other:.4g}"
            return f"({inner_text} {_SYMBOL[node.target]} {other_text})"
        return f"{op_name(node)}({inner_text})"

    def _tap_box(self, tap_id: str, names: list[str]) -> Box:
        rows, tips, kind = [], [], "tap"
        for name in names:
            entry = self.values[name]
            style = self.highlight.get(name)
            if style == "edit":
                kind = "tap_edit"
            elif style == "value" and kind == "tap":
                kind = "tap_value"
            rows.append(self._tap_text(name, entry, style))
            tips.append(f"{entry.layout}: {entry.description}")
        box = Box(tap_id, "<BR/>".join(rows), kind, self._tap_cluster(names[0]), " | ".join(tips))
        box.attrs["values"] = list(names)
        box.attrs["id"] = "+".join(names)
        return box

    def _tap_text(self, name: str, entry, style) -> str:
        short = name[len(self.prefix) + 1:]
        if entry.spec is not None and "." in short:
            short = short.split(".", 1)[1]
        dims = entry.layout[entry.layout.index("["):] if "[" in entry.layout else entry.layout
        color = "#FFFFFF" if style == "edit" else "#333333"
        dim_color = "#FFE6EE" if style == "edit" else ("#5A3A00" if style == "value" else "#7A6A3A")
        marker = {"value": "● ", "edit": "✎ "}.get(style, "")
        return f'<FONT COLOR="{color}">{esc(marker)}<B>{esc(short)}</B></FONT> {small(dims, 8, dim_color)}'

    def _tap_cluster(self, name: str) -> str | None:
        host = self.values[name].host
        return self._cluster_of(host if host in self.diagram.clusters else host.rpartition(".")[0])

    def _ghost(self, name: str, ids):
        """A value the fused op hides (or that this load lacks): dashed, hung off the op that hides it."""
        entry = self.values[name]
        location = entry.location
        node = getattr(location, "node", None)
        anchor = None
        if node is not None and self.groups.get(node) is not None:
            anchor = ids.get(self.groups[node])
        elif entry.host in self.view.locator.scopes:
            core = attention_core(self.view.locator.scopes[entry.host])
            if core is not None and self.groups.get(core.output) is not None:
                anchor = ids.get(self.groups[core.output])
        anchors = [anchor] if anchor is not None else []
        if entry.derived:
            rule = entry.spec.rule
            sources = [s.format(host=entry.host) for s in (getattr(rule, "sources", None) or (rule.source,))]
            anchors = [tap_id for tap_id, names in self.tap_ids.items() if set(names) & set(sources)]
            note, tip = "derived after the run", "computed after the run from " + ", ".join(sources)
        elif type(location).__name__ == "OnRequest":
            note, tip = "made on request", {
                "scores": "asking for it decomposes the fused sdpa into q·kᵀ, softmax and ·v (this block only)",
                "probabilities": "asking for it decomposes the fused sdpa into q·kᵀ, softmax and ·v (this block only)",
                "states": "asking for it swaps the kernel for one that returns the state after every token",
                "state": "asking for it swaps the kernel for one that returns the state at the positions asked for",
                "conv_context": "asking for it opens the causal conv to read the context it pads with",
            }.get(location.part, "a pass makes it when it is asked for")
        else:
            reason = getattr(location, "reason", "") or ""
            note = "needs the eager load" if "eager" in reason else "unavailable here"
            tip = reason
        dims = entry.layout[entry.layout.index("["):] if "[" in entry.layout else ""
        short = name[len(self.prefix) + 1:].split(".", 1)[-1]
        style = self.highlight.get(name)
        label = f'<B>{esc(short)}</B> {small(dims, 8, "#888888")}<BR/>{small(note, 8, "#888888")}'
        kind = {"edit": "tap_edit", "value": "tap_value"}.get(style, "tap_ghost")
        box = Box(f"x{len(self.diagram.boxes)}", label, kind, self._tap_cluster(name), f"{entry.layout}: {entry.description} — {tip}")
        box.attrs["values"] = [name]
        box.attrs["id"] = name
        box.attrs["ghost"] = True
        self.diagram.add(box)
        for anchor in anchors:
            self.diagram.connect(anchor, box.id, "ghost")

    def _legend(self):
        kinds = {box.kind for box in self.diagram.boxes.values()}
        legend = [("tap", "a standard value: name [layout]")]
        if "tap_value" in kinds:
            legend.append(("tap_value", "instrumented: ig.values"))
        if "tap_edit" in kinds:
            legend.append(("tap_edit", "edit slot: ig.slots"))
        if "tap_ghost" in kinds:
            legend.append(("tap_ghost", "not a node of this program (hover for why)"))
        self.diagram.legend = legend
