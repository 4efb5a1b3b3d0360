"""Run a program exported on one device on another: its recorded device arguments are rewritten.

A model built on the ``meta`` device exports without weights, but the graph records ``meta`` where
its code named a device (``arange(..., device=...)``, the tensor checks export adds). When its
weights are loaded elsewhere (``ig.load_weights``), this pass makes every such argument that device.
"""
from __future__ import annotations

import torch
from torch.fx.node import map_aggregate

from .base import BuildPass, PassResult


class OnDevice(BuildPass):
    """Every device argument naming the model's device (``meta``) becomes the device its weights were
    loaded on (``program.device``)."""

    markers = False

    def __init__(self, build):
        super().__init__(build)
        program = build.program
        self.source = next(iter(program.model.parameters()), torch.empty(0)).device
        self.target = torch.device(program.device)

    @classmethod
    def wanted(cls, build) -> bool:
        return build.program.device is not None

    def call(self, graph_module) -> PassResult:
        modified = False

        def swap(value):
            nonlocal modified
            if isinstance(value, torch.device) and value == self.source:
                modified = True
                return self.target
            return value

        for node in graph_module.graph.nodes:
            node.args = map_aggregate(node.args, swap)
            node.kwargs = map_aggregate(node.kwargs, swap)
        return PassResult(graph_module, modified)
