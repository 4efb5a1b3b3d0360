"""The whole model drawn from its exported graph: embed → the blocks, each with its kind → norm → lm_head (the
family's readout: a final mix of the streams on a model with several).

Every graph node is grouped by the top-level module it runs in (``embed_tokens``, ``layers.3``,
``norm``, ``lm_head``, the vision tower's parts and ``projector`` when there is one); the model's own
code between modules becomes wires, except what builds a tensor of its own (the attention masks from
``attention_mask``, an image scatter), which is a box. The model's values are taps on the wires, as
on a block, and a block holding values an ``InstrumentedModel`` captures or edits says how many.
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch
from torch.fx import Node

from ..kernels.ops import MARK_OP
from .diagram import Box, Cluster, Diagram, bold, esc, small
from .flow import absorbed_descendants
from .graph import GraphView, is_pass_through, is_tensorish, op_name, short_class
from .legend import TAPS, legend
from .skeleton import Drawing, derived_sources, dims, located
from .taps import tap_row

aten = torch.ops.aten
_COMPRESS_OVER = 16  # more blocks than this: runs of one kind are drawn as one box


def model_diagram(view: GraphView, *, highlight: dict[str, str] | None = None) -> Diagram:
    return _Model(view, highlight or {}).diagram


def _top(names: list[str]) -> str | None:
    """The top-level part a scope belongs to: ``layers.3``, ``embed_tokens``, ``vision.blocks.0``."""
    if not names:
        return None
    first = names[0]
    match = re.match(r"(vision\.(?:blocks|layers)\.\d+|vision\.[^.]+|layers\.\d+|[^.]+)", first)
    return match.group(1) if match else first


class _Model(Drawing):
    def __init__(self, view: GraphView, highlight: dict[str, str]):
        self.view, self.highlight = view, highlight
        self.mixers = view.block_mixers
        self.runs = self._runs()
        self.values = {name: entry for name, entry in view.catalogue.items()
                       if (entry.host in ("", "vision") and entry.spec is not None) or
                       (name in highlight and self._on_a_wire(entry))}
        self._build([n for n in view.graph.nodes if n.op != "output"])

    def _title(self) -> str:
        family = self.view.family
        counts = ", ".join(f"{self.mixers.count(mixer.module)} {mixer.title}" for mixer in family.mixers.values())
        return f"{type(self.view.model).__name__}  ·  {len(self.mixers)} blocks  ·  {counts}"

    # -- groups ----------------------------------------------------------------------------------
    def _runs(self) -> dict[str, str]:
        """``layers.i`` -> the box it is drawn in (itself, or its run of same-kind blocks on big models)."""
        boxes = {}
        family = self.view.family
        depth = family.vision_blocks(self.view.config)
        for prefix, kinds in (("layers", self.mixers), ("vision.layers", ["vision"] * depth)):
            boxes.update({f"{prefix}.{i}": f"{prefix}.{i}" for i in range(len(kinds))})
            if len(kinds) <= _COMPRESS_OVER:
                continue
            marked = {int(m.group(1)) for name in self.highlight
                      if (m := re.match(rf"{re.escape(prefix)}\.(\d+)\.", name))}
            start = 0
            for i in range(1, len(kinds) + 1):
                if i == len(kinds) or kinds[i] != kinds[start] or i in marked or (i - 1) in marked:
                    if i - start > 1:
                        for j in range(start, i):
                            boxes[f"{prefix}.{j}"] = f"{prefix}.{start}-{i - 1}"
                    start = i
        return boxes

    def _absorbed(self, node: Node) -> bool:
        """Carried on the wire from its input: an input port's marker, a re-view in the model's own code."""
        if node.target is MARK_OP:
            return str(node.args[1]).endswith(".input")
        return not self.view.scopes(node) and is_pass_through(node)

    def _group(self):
        view = self.view
        located = set()  # the nodes of the model's values: model code stops at them, so they stay wires
        for entry in view.catalogue.values():
            node = getattr(entry.location, "node", None)
            if entry.spec is not None and entry.host in ("", "vision") and node is not None:
                located.add(node)
        for node in self.nodes:
            if node.op == "placeholder":
                self.groups[node] = ("input", node.name) if node.name in view.inputs and is_tensorish(node) else None
            elif not is_tensorish(node):
                self.groups[node] = None
            elif self._absorbed(node):
                root = node.args[0]
                self.groups[node] = self.groups.get(root)
            elif (top := _top(view.scopes(node))) is not None:
                self.groups[node] = ("module", self.runs.get(top, top))
            else:  # the model's own code: masks from attention_mask, or an op on the activations
                sources = {self.groups.get(u) for u in node.all_input_nodes} - {None}
                if not sources:
                    self.groups[node] = None
                elif all(s[0] in ("input", "glue") for s in sources):
                    inputs = tuple(sorted({n for s in sources for n in ((s[1],) if s[0] == "input" else s[1])}))
                    self.groups[node] = ("glue", inputs)
                else:  # joins the box of the model code it reads, if it reads one
                    ops = sorted({s for s in sources if s[0] == "op"}, key=str)
                    reads_value = any(u in located or (self._absorbed(u) and u.args[0] in located)
                                      for u in node.all_input_nodes)
                    self.groups[node] = ops[0] if len(ops) == 1 and not reads_value else ("op", node.name)

    def _outside_group(self, node: Node):
        return None

    def _sink(self, user: Node):
        return ("output", "output") if user.op == "output" else None

    def _on_a_wire(self, entry) -> bool:
        inside = "|".join([*(mixer.module for mixer in self.view.family.mixers.values()), "mlp"])
        return located(entry) is not None and not re.match(rf"layers\.\d+\.({inside})", entry.name)

    def _tap_list(self, flows):
        by_node = defaultdict(list)
        self.derived = []
        for name, entry in list(self.values.items()):
            node = getattr(entry.location, "node", None)
            if entry.derived:
                self.derived.append(name)
            elif node is not None and self.groups.get(node) is not None and (
                    node.op == "placeholder" or self._leaves_its_box(node, flows)):
                by_node[node].append(name)
            else:  # inside a box (a block's layer_mid): the block's label counts it
                del self.values[name]
        self.tap_ids, self.tap_nodes, taps = {}, {}, []
        for node in sorted(by_node, key=self.view.index.get):
            if node.op == "placeholder":  # an input is its own tap
                self.tap_ids[("input", node.name)] = by_node[node]
                continue
            tap_id = f"t{len(self.tap_ids)}"
            self.tap_ids[tap_id] = by_node[node]
            self.tap_nodes[tap_id] = node
            taps.append((node, tap_id, self.groups[node]))
        return taps

    def _leaves_its_box(self, node: Node, flows) -> bool:
        """Whether ``node``'s tensor is read outside the box it is computed in (a wire carries it)."""
        start = node
        while start.target is MARK_OP:
            start = start.args[0]
        carried = absorbed_descendants(start, self._absorbed)
        return any(flow.via in carried and flow.origin == self.groups[node] for flow in flows)

    # -- drawing ---------------------------------------------------------------------------------
    def _draw(self, flows):
        d, view = self.diagram, self.view
        if any(s.startswith(("vision.", "projector")) for s in view.types):
            d.clusters["vision"] = Cluster("vision", "vision encoder", "vision")
        ids, members = self._ids, self._members()
        keys = set(members) | {f.dst for f in flows if isinstance(f.dst, tuple)}
        used = {f.src for f in flows} | {f.dst for f in flows}
        self._add_boxes(keys & used, members,
                        lambda k: min((view.index[n] for n in members.get(k, ())), default=10 ** 9))
        self._add_taps()
        main = self._main_path(flows)

        def kind_of(flow, src, dst):
            if flow.dst == ("output", "output") and flow.origin != ("module", "lm_head"):
                return "data"  # what else the program returns (the vision tower's hidden states)
            if flow.src in main and flow.dst in main:
                return "block"
            return "context" if d.boxes[src].kind in ("context", "glue", "rotary") else "data"

        self._add_wires(flows, kind_of)
        for name in self.derived:
            entry = self.values[name]
            sources = derived_sources(entry)
            anchors = [a for a in self.tap_ids if set(self.tap_ids[a]) & set(sources)]
            label = (f'<B>{esc(name)}</B> {small(dims(entry.layout), 8, "#888888")}<BR/>'
                     f'{small("derived after the run", 8, "#888888")}')
            box = d.add(Box(f"x{len(d.boxes)}", label, self._tap_kind([name], "tap_ghost"), None,
                            f"{entry.layout}: {entry.description}", {"values": [name], "id": name}))
            for anchor in anchors:
                anchor_id = anchor if isinstance(anchor, str) else ids.get(anchor)
                if anchor_id in d.boxes:
                    d.connect(anchor_id, box.id, "ghost")
        d.legend = legend(d, tuple((_block_style(mixer), f"{mixer.title} block ({mixer.module})")
                                   for mixer in self.view.family.mixers.values())
                          + TAPS + (("tap_ghost", "derived from a value after the run"),))

    def _main_path(self, flows) -> set:
        """The residual stream's boxes: the embedding, the blocks, the final norm, and the taps between."""
        main = {("module", "embed_tokens"), *(("module", m) for m in self.view.family.readout), ("output", "output"),
                ("module", "vision.patch_embed"), ("module", "projector")}
        main |= {("module", box) for box in self.runs.values()}
        ops = {f.dst for f in flows if isinstance(f.dst, tuple) and f.dst[0] == "op"}
        for _ in range(3):  # the model's code on the stream: the image scatter, the vision pos-embed add
            for op in ops - main:
                if (any(f.dst == op and f.origin in main for f in flows)
                        and any(f.origin == op and self._reaches(f, main, flows) for f in flows)):
                    main.add(op)
        for tap_id, node in self.tap_nodes.items():
            reached = main | set(self.tap_nodes)
            if self.groups[node] in main and any(f.src == tap_id and f.dst in reached for f in flows):
                main.add(tap_id)
        return main

    def _reaches(self, flow, main, flows) -> bool:
        """Whether a wire ends at a main box, through taps."""
        seen = set()
        while isinstance(flow.dst, str) and flow.dst not in seen:
            seen.add(flow.dst)
            flow = next((f for f in flows if f.src == flow.dst), None)
            if flow is None:
                return False
        return flow.dst in main

    def _box(self, key, nodes, box_id) -> Box | None:
        view, kind, name = self.view, key[0], key[1]
        if kind == "input":
            names = self.tap_ids.get(key)
            if names:
                box = self._tap_box(box_id, names)
                box.attrs["group"] = "main" if name == "input_ids" else ""
                return box
            kind = "io" if name in ("input_ids", "attention_mask") else "io_side"
            return Box(box_id, bold(name), kind, None, f"the program input {name}")
        if kind == "output":
            return Box(box_id, bold("output") + "<BR/>" + small("what the model returns", 9, "#DDDDDD"), "io", None,
                       "the program's output", {"group": "main"})
        if kind == "glue":
            ops = sorted({op_name(n) for n in nodes})
            steps = [op_name(n) for n in sorted(nodes, key=view.index.__getitem__) if not is_pass_through(n)]
            text = "masks" if "attention_mask" in name else "  →  ".join(dict.fromkeys(steps[:3]))
            return Box(box_id, esc(text) + "<BR/>" + small("from " + ", ".join(name), 8), "glue", None,
                       "the model's own code: " + ", ".join(ops))
        if kind == "op":
            nodes = sorted(nodes, key=view.index.__getitem__)
            names = [op_name(n) for n in nodes if not is_pass_through(n)]
            names = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
            fed = {group for n in nodes for u in n.all_input_nodes
                   if (group := self.groups.get(u)) is not None and group != key}
            cluster = "vision" if any(str(k[1]).startswith(("vision", "projector")) for k in fed) else None
            return Box(box_id, esc("  →  ".join(names[:4]) + ("  →  …" if len(names) > 4 else "")), "glue", cluster,
                       "\n".join(n.format_node() for n in nodes))
        if re.match(r"layers\.\d+(-\d+)?$", name):
            return self._block_box(name, box_id)
        if re.match(r"vision\.layers\.\d+(-\d+)?$", name):
            first, _, last = name.removeprefix("vision.layers.").partition("-")
            title = name if not last else f"vision.layers.{first} – {last}  (× {int(last) - int(first) + 1})"
            subtitle = small(f"vision block  ·  {short_class(view.types.get(name, ''))}")
            return Box(box_id, bold(title) + "<BR/>" + subtitle, "block_vision", "vision",
                       f"{name}: a vision encoder block")
        cluster = "vision" if name.startswith(("vision.", "projector")) else None
        type_name = short_class(view.types.get(name, ""))
        sub = type_name
        linear = next((n for n in nodes if n.target in (aten.linear.default, aten.embedding.default)), None)
        if linear is not None and type_name in ("Linear", "Embedding"):
            rows, cols = linear.args[0 if linear.target is aten.embedding.default else 1].meta["val"].shape[:2]
            embedding = linear.target is aten.embedding.default
            sub = f"{type_name} {rows} × {cols}" if embedding else f"{type_name} {cols} → {rows}"
        if name == "rotary_emb":
            sub = f"{type_name}  ·  cos, sin for the attention blocks"
        box_kind = "rotary" if name == "rotary_emb" else ("norm" if "Norm" in type_name else "module")
        attrs = {"group": "main"} if name in ("embed_tokens", *view.family.readout) else {}
        return Box(box_id, bold(name) + "<BR/>" + small(sub), box_kind, cluster, f"{name} ({view.types.get(name, '')})",
                   attrs)

    def _block_box(self, name: str, box_id: str) -> Box:
        first, _, last = name.removeprefix("layers.").partition("-")
        blocks = range(int(first), int(last or first) + 1)
        mixer = self.mixers[blocks[0]]
        title = name if len(blocks) == 1 else f"layers.{blocks[0]} – {blocks[-1]}  (× {len(blocks)})"
        sub = f"{self.view.family.title(mixer)}  ·  {mixer}"
        marked = [n for n in self.highlight
                  if any(n.startswith(f"layers.{b}.") for b in blocks) and n not in self.values]
        label = bold(title) + "<BR/>" + small(sub, 9, "#333333")
        if marked:
            edits = sum(self.highlight[n] == "edit" for n in marked)
            text = ", ".join(p for p in (f"{len(marked) - edits} captured" if len(marked) > edits else "",
                                         f"{edits} edited" if edits else "") if p)
            label += "<BR/>" + small("● " + text, 9, "#B85C00" if not edits else "#A0154C")
        kind = _block_style(self.view.family.mixer(mixer))
        return Box(box_id, label, kind, None, f"{name}: {self.view.family.title(mixer)} block", {"group": "main"})

    def _tap_box(self, tap_id: str, names: list[str]) -> Box:
        rows, tips = [], []
        for name in names:
            entry = self.values[name]
            rows.append(tap_row(name, entry.layout, self.highlight.get(name), value_color="#7A6A3A"))
            tips.append(f"{entry.layout}: {entry.description}")
        vision = all(self.values[n].host == "vision" for n in names) and not any(
            n.endswith("image_features") for n in names)
        cluster = "vision" if "vision" in self.diagram.clusters and vision else None
        return Box(tap_id, "<BR/>".join(rows), self._tap_kind(names), cluster, " | ".join(tips),
                   {"values": list(names), "id": "+".join(names), "group": "main"})


def _block_style(mixer) -> str:
    """A block's style in the model diagram: by whether its mixer carries a recurrent state."""
    return "block_delta" if mixer.recurrent else "block_attn"
