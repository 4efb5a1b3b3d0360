"""The steps every diagram takes, shared by the block (``block.py``) and the model (``model.py``).

A diagram groups some of the graph's nodes into boxes, wires the groups by the tensors they read
from each other (``flow.build_flows``), splices each value's tap point into the wires that carry it
(``flow.splice_taps``), then draws: one box per group, one per tap, one wire per (box, box) pair.
``Drawing`` runs those steps; a subclass says how its nodes group and how its boxes look.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from collections import defaultdict

from ..values.locate import Found
from .diagram import Box, Diagram
from .flow import build_flows, splice_taps
from .graph import GraphView


def located(entry):
    """The graph node a catalogue entry's value is at, or None (made on request, derived, unavailable)."""
    location = entry.location
    return location.node if isinstance(location, Found) else None


def derived_sources(entry) -> list[str]:
    """The values a derived value is computed from, by name."""
    rule = entry.spec.rule
    return [s.format(host=entry.host) for s in (getattr(rule, "sources", None) or (rule.source,))]


def dims(layout: str) -> str:
    """``"residual [batch, seq, hidden]"`` -> ``"[batch, seq, hidden]"``."""
    return layout[layout.index("["):] if "[" in layout else layout


class Drawing(ABC):
    """One diagram of ``self.nodes``, built by ``_build``. A subclass provides:

    ``_group()`` (fill ``self.groups``: node -> group key or None), ``_outside_group(node)`` (the group
    of a tensor read from outside ``self.nodes``), ``_sink(user)`` (the group of a reader outside),
    ``_absorbed(node)`` (drawn as part of the wire from its input), ``_tap_list(flows)`` (the taps as
    ``(node, tap id, group of node)``, with ``self.tap_ids``: tap id -> value names), ``_title()``,
    ``_box(key, nodes, box_id)``, ``_tap_box(tap_id, names)`` and ``_draw(flows)``.
    """

    highlight: dict[str, str]
    view: GraphView
    tap_ids: dict[str | tuple[str, str], list[str]]  # set by _tap_list; a str id is drawn as a tap box

    def _build(self, nodes) -> None:
        self.nodes = nodes
        self.inside = set(nodes)
        self.groups: dict = {}
        self._group()
        flows = build_flows(self.nodes, self.groups.get, self._outside_group, self._sink)
        flows = splice_taps(flows, self._tap_list(flows), self._absorbed)
        self.diagram = Diagram(self._title())
        self._ids: dict = {}
        self._draw(flows)

    # -- what a subclass provides --------------------------------------------------------------
    @abstractmethod
    def _group(self) -> None:
        ...

    @abstractmethod
    def _outside_group(self, node):
        ...

    @abstractmethod
    def _sink(self, user):
        ...

    @abstractmethod
    def _absorbed(self, node) -> bool:
        ...

    @abstractmethod
    def _tap_list(self, flows) -> list[tuple]:
        ...

    @abstractmethod
    def _title(self) -> str:
        ...

    @abstractmethod
    def _box(self, key, nodes, box_id: str) -> Box | None:
        ...

    @abstractmethod
    def _tap_box(self, tap_id: str, names: list[str]) -> Box:
        ...

    @abstractmethod
    def _draw(self, flows) -> None:
        ...

    # -- drawing helpers -------------------------------------------------------------------------
    def _id_letter(self, key) -> str:
        return "g"

    def _box_id(self, key) -> str:
        """The drawn id of group ``key``, numbered in the order boxes are first asked for."""
        if key not in self._ids:
            self._ids[key] = f"{self._id_letter(key)}{len(self._ids)}"
        return self._ids[key]

    def _members(self, keep=lambda node, key: True) -> dict:
        """Each drawn group's nodes (``keep`` filters them)."""
        members = defaultdict(list)
        for node, key in self.groups.items():
            if key is not None and keep(node, key):
                members[key].append(node)
        return members

    def _add_boxes(self, keys, members, order) -> dict:
        """Draw one box per group key, in ``order``; returns the drawn boxes by key."""
        drawn = {}
        for key in sorted(keys, key=order):
            box = self._box(key, members.get(key, []), self._box_id(key))
            if box is not None:
                drawn[key] = self.diagram.add(box)
        return drawn

    def _add_taps(self) -> None:
        for tap_id, names in self.tap_ids.items():
            if isinstance(tap_id, str):
                self.diagram.add(self._tap_box(tap_id, names))

    def _add_wires(self, flows, kind_of, ports_of=None) -> None:
        """One wire per pair of drawn boxes a flow joins; ``kind_of(flow, src id, dst id)`` styles it. A wire
        that carries several residual streams side by side (hyper-connections) is drawn as their bundle,
        labelled with their count where a bundle starts."""
        d, ids, seen = self.diagram, self._ids, set()
        for flow in flows:
            src = flow.src if isinstance(flow.src, str) else ids.get(flow.src)
            dst = flow.dst if isinstance(flow.dst, str) else ids.get(flow.dst)
            if src not in d.boxes or dst not in d.boxes or src == dst or (src, dst) in seen:
                continue
            seen.add((src, dst))
            wire = d.connect(src, dst, kind_of(flow, src, dst), **(ports_of(flow) if ports_of else {}))
            wire.streams = self.view.streams(flow.via)
        bundled = {wire.dst for wire in d.wires if wire.streams > 1}
        for wire in d.wires:  # a bundle says how many streams it holds where it starts
            if wire.streams > 1 and wire.src not in bundled:
                wire.label = f"{wire.streams} streams"

    def _tap_kind(self, names, default: str = "tap") -> str:
        styles = {self.highlight.get(n) for n in names}
        return "tap_edit" if "edit" in styles else ("tap_value" if "value" in styles else default)
