"""A value's tap point: a small box spliced into the wire that carries it, labelled ``name [layout]``,
filled by how it is marked (standard, captured by ``ig.values``, edited by ``ig.slots``); and, on a
block, the values no node of the program holds, drawn dashed off the op that hides them."""
from __future__ import annotations

from collections import defaultdict

from ..values.locate import OnRequest, attention_core
from .diagram import Box, esc, small
from .host import BlockHost
from .legend import TAPS, legend
from .skeleton import derived_sources, dims, located



def tap_row(short: str, layout: str, style: str | None, value_color: str = "#5A3A00") -> str:
    """One value's line on a tap: a marker for captured (●) or edited (✎), its name, its dims."""
    color = "#FFFFFF" if style == "edit" else "#333333"
    dim_color = "#FFE6EE" if style == "edit" else (value_color if style == "value" else "#7A6A3A")
    marker = {"value": "● ", "edit": "✎ "}.get(style, "") if style else ""
    return f'<FONT COLOR="{color}">{esc(marker)}<B>{esc(short)}</B></FONT> {small(dims(layout), 8, dim_color)}'


class BlockTaps(BlockHost):
    """A block's taps and ghosts (mixed into the block diagram, which holds the values and groups)."""

    def _tap_list(self, flows=None):
        """The taps as ``(node, tap id, group of node)`` in graph order; the other values are ghosts."""
        by_node = defaultdict(list)
        self.ghosts = []
        for name, entry in self.values.items():
            node = located(entry)
            if node is not None and (self.groups.get(node) is not None or node is self.residual_in):
                by_node[node].append(name)
            else:
                self.ghosts.append(name)
        self.tap_ids = {}
        taps = []
        for node in sorted(by_node, key=self.view.index.get):
            tap_id = f"t{len(self.tap_ids)}"
            self.tap_ids[tap_id] = by_node[node]
            taps.append((node, tap_id, self._group_of(node)))
        self.tap_nodes = {tap_id: node for node, tap_id, _ in taps}
        return taps

    def _tap_box(self, tap_id: str, names: list[str]) -> Box:
        rows, tips = [], []
        for name in names:
            entry = self.values[name]
            rows.append(tap_row(self._short(name, entry), entry.layout, self.highlight.get(name)))
            tips.append(f"{entry.layout}: {entry.description}")
        box = Box(tap_id, "<BR/>".join(rows), self._tap_kind(names), self._tap_cluster(names[0]), " | ".join(tips))
        box.attrs["values"] = list(names)
        box.attrs["id"] = "+".join(names)
        return box

    def _short(self, name: str, entry) -> str:
        """A value's name within the block (within its module for a standard value)."""
        short = name[len(self.prefix) + 1:]
        if entry.spec is not None and "." in short:
            short = short.split(".", 1)[1]
        return short

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
            sources = derived_sources(entry)
            anchors = [tap_id for tap_id, names in self.tap_ids.items() if set(names) & set(sources)]
            note, tip = "derived after the run", "computed after the run from " + ", ".join(sources)
        elif isinstance(location, OnRequest):
            note, tip = "made on request", location.rewrite.note
        else:
            reason = getattr(location, "reason", "") or ""
            note = "needs the eager load" if "eager" in reason else "unavailable here"
            tip = reason
        short = name[len(self.prefix) + 1:].split(".", 1)[-1]
        label = f'<B>{esc(short)}</B> {small(dims(entry.layout) if "[" in entry.layout else "", 8, "#888888")}' \
                f'<BR/>{small(note, 8, "#888888")}'
        box = Box(f"x{len(self.diagram.boxes)}", label, self._tap_kind([name], "tap_ghost"), self._tap_cluster(name),
                  f"{entry.layout}: {entry.description} — {tip}")
        box.attrs["values"] = [name]
        box.attrs["id"] = name
        box.attrs["ghost"] = True
        self.diagram.add(box)
        for anchor in anchors:
            self.diagram.connect(anchor, box.id, "ghost")

    def _legend(self):
        rows = TAPS + (("tap_ghost", "not a node of this program (hover for why)"),)
        self.diagram.legend = legend(self.diagram, rows, always=("tap",))
