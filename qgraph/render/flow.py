"""Condensing a graph into drawn boxes and wires, and putting the value taps on the wires.

Every graph node gets a *group* (the box it is drawn in) or ``None`` (not drawn: parameters, shape
arithmetic, checks). A wire runs between two groups for every tensor one reads from the other; it
remembers the node it leaves through (``via``), so a value located at a node is drawn as a tap
point spliced into exactly the wires that carry that node's tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node

from ..kernels.ops import MARK_OP
from .graph import tensor_inputs


@dataclass
class Flow:
    src: object  # group key (or a tap id once a tap is spliced in)
    dst: object
    via: Node  # the node whose tensor the wire carries out of ``origin``
    origin: object  # the group the wire leaves


def build_flows(nodes, group, outside_group, sink_of) -> list[Flow]:
    """The wires between groups: ``group(node)`` for drawn nodes (inside), ``outside_group(node)`` for
    what flows in from elsewhere, ``sink_of(user)`` for readers outside (None: not drawn)."""
    flows, seen = [], set()
    inside = set(nodes)
    for node in nodes:
        dst = group(node)
        if dst is None:
            continue
        for source in tensor_inputs(node):
            src = group(source) if source in inside else outside_group(source)
            if src is None or src == dst or (src, dst, source) in seen:
                continue
            seen.add((src, dst, source))
            flows.append(Flow(src, dst, source, src))
        for user in node.users:
            if user in inside:
                continue
            sink = sink_of(user)
            if sink is not None and (dst, sink, node) not in seen:
                seen.add((dst, sink, node))
                flows.append(Flow(dst, sink, node, dst))
    return flows


def absorbed_descendants(node: Node, absorbed) -> set[Node]:
    """``node`` and every node that only carries its tensor on (re-views, markers, getitems)."""
    found, stack = {node}, [node]
    while stack:
        current = stack.pop()
        for user in current.users:
            if (user not in found and (user.target is MARK_OP or absorbed(user)) and user.args
                    and user.args[0] is current):
                found.add(user)
                stack.append(user)
    return found


def splice_taps(flows: list[Flow], taps: list[tuple[Node, str, object]], absorbed) -> list[Flow]:
    """Splice each tap (``(node, tap id, group of node)``, in graph order) into the wires carrying
    its node's tensor; a tap on a tensor no drawn box reads hangs off its group as a dead end."""
    spliced = set()
    for node, tap_id, origin in taps:
        start = node
        while start.target is MARK_OP:  # a port marker is the tensor itself: its other readers carry it too
            start = start.args[0]
        carried = absorbed_descendants(start, absorbed)
        chosen = [flow for flow in flows if flow.origin == origin and flow.via in carried and flow.dst not in spliced]
        source = chosen[0].src if chosen else origin
        for flow in chosen:
            flow.src = tap_id
        flows.append(Flow(source, tap_id, node, origin))
        spliced.add(tap_id)
    return flows
