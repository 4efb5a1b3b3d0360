"""Edit slots: a rewrite that makes a value's readers read it through a slot that may change it."""
from __future__ import annotations

import torch
from torch.fx import Graph, Node

from ..edits import Target, apply_edit
from ..ops import MARK_OP
from . import views
from .locate import Found


class EditSlot(torch.nn.Module):
    """Passes its input through, or applies ``fixed`` (given at instrument time) and then ``edit``
    (set for one call). With neither it is one Python call that returns its input."""

    def __init__(self, target: Target, view: tuple = (), fixed=None):
        super().__init__()
        self.target, self.view, self.fixed, self.edit = target, view, fixed, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed is None and self.edit is None:
            return x
        value = views.apply(x, self.view)  # edits see the value as it is served
        for edit in (self.fixed, self.edit):
            if edit is not None:
                value = apply_edit(edit, value, self.target)
        return views.undo(value, self.view)


def insert_edit_slots(graph: Graph, slots: dict[str, tuple[Found, EditSlot, bool]]) -> dict[str, Node]:
    """Put each slot after its value's node and rewire that node's readers to the slot.

    ``slots`` maps a value name to (where it is, its slot, whether it is a module port). A module
    port's slot feeds only that module (the marker's readers); a standard value's slot feeds every
    reader of the tensor, so e.g. an edit of ``layer_mid`` reaches both the MLP and the residual add.
    Returns the slot node of each name (tap those to capture the edited value).
    """
    nodes = {}
    for name, (found, slot, is_port) in slots.items():
        node = found.node
        if not is_port:
            while node.target is MARK_OP:  # the tensor itself, not one module's view of it
                node = node.args[0]
        readers = list(node.users)
        with graph.inserting_after(node):
            slot_node = graph.call_module(name_of(name), (node,))
        slot_node.meta["val"] = node.meta.get("val")
        for reader in readers:
            reader.replace_input_with(node, slot_node)
        nodes[name] = slot_node
    return nodes


def name_of(value: str) -> str:
    """The submodule name of a value's slot (``layers.3.layer_output`` -> ``edit__layers_3_layer_output``)."""
    return "edit__" + value.replace(".", "_")
