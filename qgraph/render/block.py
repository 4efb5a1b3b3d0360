"""One block drawn from the exported graph: its modules, the ops between them, and every value on it.

Two levels of detail share one method: each graph node of the block is put in a group (a drawn
box), wires are the tensors read between groups, and each value's node becomes a tap point spliced
into the wires that carry it.

* ``detail="modules"``: a leaf module (``q_proj``, ``q_norm``, ``act_fn``) is one box; the code
  between modules keeps only what computes (re-views, casts and markers are wires), elementwise
  runs fuse into one box (``+ dt_bias → softplus → × −exp(A_log)``), the rotary's slices and
  rotations fuse into one box, and parameters feed the labels, not boxes.
* ``detail="ops"``: every graph node of the block is a box, in nested clusters by module scope.

The parts: ``grouping.py`` (which box each node is in), ``labels.py`` (what a box says), ``taps.py``
(the values on the wires), ``skeleton.py`` (the steps every diagram takes); this file lays them out:
the clusters, the residual stream's spine and the wires.
"""
from __future__ import annotations

from collections import defaultdict

from .diagram import Cluster, Diagram
from .graph import GraphView, short_class
from .grouping import BlockGrouping, is_core
from .labels import BlockLabels
from .taps import BlockTaps

__all__ = ["block_diagram", "is_core", "mixer_style"]


def mixer_style(family, module: str) -> str:
    """The drawing style of a mixer's cluster: a recurrent one (a carried state) or an attention."""
    return "mixer_recurrent" if family.mixer(module).recurrent else "mixer_attention"


def block_diagram(view: GraphView, layer: int, *, detail: str = "modules",
                  highlight: dict[str, str] | None = None, vision: bool = False) -> Diagram:
    """The diagram of block ``layer`` (of the vision tower with ``vision``); ``highlight`` maps value
    names to "value" (instrumented) or "edit"."""
    return _Block(view, layer, highlight or {}, detail, vision).diagram


class _Block(BlockGrouping, BlockLabels, BlockTaps):
    """Groups one block's nodes into boxes, wires them, splices the values in, and draws the result."""

    def __init__(self, view: GraphView, layer: int, highlight: dict[str, str], detail: str, vision: bool = False):
        self.view, self.layer, self.highlight, self.detail, self.vision = view, layer, highlight, detail, vision
        self.prefix = f"vision.layers.{layer}" if vision else f"layers.{layer}"
        self.mixer = view.family.vision_mixer if vision else view.block_mixers[layer]
        self._build(self._block_nodes())

    def _title(self) -> str:
        model = type(self.view.model).__name__
        if self.vision:
            return f"{self.prefix}  ·  vision encoder block  ·  {model}  ·  detail={self.detail}"
        kind = self.view.family.title(self.view.block_mixers[self.layer])  # a text block's mixer
        layer_type = self.view.family.kinds(self.view.config)[self.layer]
        return f"{self.prefix}  ·  {kind} block ({layer_type})  ·  {model}  ·  detail={self.detail}"

    def _cluster_of(self, scope: str) -> str | None:
        """The drawn cluster a box of ``scope`` sits in: the scope itself or its nearest drawn parent."""
        while scope and scope not in self.diagram.clusters:
            scope = scope.rpartition(".")[0]
        return scope or None

    def _id_letter(self, key) -> str:
        return "g" if key[0] in ("op", "module", "param") else key[0][0]

    def _draw(self, flows):
        d = self.diagram
        self._clusters()
        members = self._members(lambda node, key: key[0] in ("op", "module") and (
            self.detail == "ops" or self.kinds.get(node) != "pass"))
        keys = (set(members) | {f.src for f in flows if isinstance(f.src, tuple)}
                | {f.dst for f in flows if isinstance(f.dst, tuple)})

        def first(key):
            return min((self.view.index[n] for n in members.get(key, ())), default=-1 if key[0] == "in" else 10 ** 9)

        spine = self._spine(flows)
        for key, box in self._add_boxes(keys, members, lambda k: (first(k), str(k))).items():
            if key in spine:
                box.attrs["group"] = "spine"
        self._add_taps()
        for tap_id in self._spine_taps:
            d.boxes[tap_id].attrs["group"] = "spine"

        on_spine = spine | self._spine_taps

        def kind_of(flow, src, dst):
            if flow.src in on_spine and flow.dst in on_spine:
                return "spine"
            context = isinstance(flow.src, tuple) and flow.src[0] == "in" and flow.src[1] != "residual"
            return "context" if context else "data"

        self._add_wires(flows, kind_of, self._ports if self.detail == "modules" else None)
        for name in self.ghosts:
            self._ghost(name, self._ids)
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

    def _clusters(self):
        """The block, and its modules that hold others (ops: every module), as nested clusters."""
        d, view = self.diagram, self.view
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
                what = "attention" if self.vision else self.view.family.title(relative)
                style = "mixer_attention" if self.vision else mixer_style(self.view.family, self.mixer)
                kind, label = style, f"{relative}  ·  {what}  ·  {type_name}"
            elif scope.endswith(".mlp"):
                kind, label = "mlp", f"{relative}  ·  {type_name}"
            else:
                kind, label = "scope", f"{relative}  ·  {type_name}"
            d.clusters[scope] = Cluster(scope, label, kind, parent)

    def _ports(self, flow) -> dict[str, str]:
        """Where a wire meets a core or split box: ``headport``/``tailport``."""
        ports = {}
        head_port, tail_port = self._port(flow, "head"), self._port(flow, "tail")
        if head_port and not isinstance(flow.dst, str):
            ports["headport"] = head_port
        if tail_port and not isinstance(flow.src, str):
            ports["tailport"] = tail_port
        return ports

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
            if self._group_of(node) in spine and (into & (spine | set(self.tap_ids)) or not into):
                self._spine_taps.add(tap_id)
        return spine
