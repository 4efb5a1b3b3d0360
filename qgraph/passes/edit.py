"""Edit slots: a rewrite that makes a value's readers read it through a slot that may change it.

A slot may read other values of the forward (``reads``: what its edits' ``Read``s, function edits and
relative steering need, the call's ``attention_mask`` among them): they are wired in as its inputs, so
an edit that reads the forward is part of the graph (exact, differentiable, compiled). A read must come
before the value edited; the pass says so otherwise.

A slot holds no per-call state. The edits of one call live in a context variable that
``applying(edits)`` sets for the call and restores after it, so calls nest (an edit function may
call an instrumented model) and two threads never see each other's edits.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from types import MappingProxyType

import torch

from ..edits import Forward, Target, apply_edit, needs
from ..errors import EditError
from ..kernels.ops import MARK_OP
from ..kernels import views
from .base import BuildPass, PassResult


# The edits of the call running in this context: {slot: edit} (none outside ``applying``: a read-only empty one)
_CALL_EDITS: contextvars.ContextVar[Mapping] = contextvars.ContextVar("qgraph_call_edits",
                                                                     default=MappingProxyType({}))


@contextlib.contextmanager
def applying(edits: Mapping[EditSlot, object]):
    """Apply ``{slot: edit}`` to the calls made in this block (this thread or task only); the
    edits in force before are back when it ends."""
    token = _CALL_EDITS.set(dict(edits))
    try:
        yield
    finally:
        _CALL_EDITS.reset(token)


READ_ONLY_HINT = {
    "next_token_probs": "edit 'logits' instead",
    "input_size": "call with other inputs instead",
    "input_ids": "pass other tokens instead",
    "attention_mask": "pass another attention_mask instead",
}


class EditSlot(torch.nn.Module):
    """Passes its input through, or applies ``fixed`` (given at instrument time) and then the
    edit the current call gives it (``applying``). With neither it is one Python call that returns
    its input. Under ``torch.compile`` only the fixed edit is traced: a call with per-call edits runs
    the eager program. ``reads``: ``((Target, view), ...)`` of the values wired in after its input
    (``InsertEditSlots``), handed to its edits as a ``Forward``."""

    def __init__(self, target: Target, view: tuple = (), fixed=None, regions_only: bool = False, reads: tuple = ()):
        super().__init__()
        self.target, self.view, self.fixed, self.regions_only = target, view, fixed, regions_only
        self.reads = tuple(reads)
        if fixed is not None:
            self.check(fixed)

    @classmethod
    def at(cls, entry, fixed=None, reads=()) -> EditSlot:
        """The slot at a catalogue ``entry`` (with ``fixed``, an edit fixed into the program, and the catalogue
        entries of the values it ``reads``), or an ``EditError`` saying why the value cannot be edited and
        what to edit instead."""
        if entry.read_only:
            raise EditError(f"'{entry.name}' is read-only ({entry.description}); " + READ_ONLY_HINT.get(
                entry.name, "edit the value it is derived from"))
        if entry.derived:
            raise EditError(f"'{entry.name}' is computed after the run from other values ({entry.description}); "
                            f"edit the value it is derived from")
        return cls(Target(entry.name, entry.layout, entry.dims), entry.location.view, fixed=fixed,
                   regions_only=entry.spec is not None and entry.spec.rule.region_edits_only,
                   reads=tuple((Target(read.name, read.layout, read.dims), read.location.view) for read in reads))

    @property
    def read_names(self) -> tuple[str, ...]:
        """The values wired into this slot, in input order."""
        return tuple(target.name for target, _ in self.reads)

    def check(self, edit) -> None:
        """Refuse an edit that is not an affine map where the value is edited inside a kernel
        (``regions_only``), and one that reads what is not wired in."""
        if self.regions_only and not getattr(edit, "affine", False):
            raise EditError(f"{type(edit).__name__ if hasattr(edit, 'affine') else 'a function edit'} at "
                            f"{self.target.describe()}: this value is edited inside the delta rule's recurrence, "
                            f"one token's write at a time, where a Python function (or a mean over the tokens) "
                            f"cannot run; give Replace, Add, Scale or Zero (with positions=/heads= for a region)")
        missing = [name for name in needs(edit) if name not in self.read_names]
        if missing:
            raise EditError(f"{type(edit).__name__} at {self.target.describe()} reads {missing}, which this program "
                            f"does not wire into the slot: give the edit per call (ig(..., edits=...)) or fixed "
                            f"(instrument(..., edits=...)), where reads are wired in")

    def forward(self, x: torch.Tensor, *reads: torch.Tensor) -> torch.Tensor:
        edit = None if torch.compiler.is_compiling() else _CALL_EDITS.get().get(self)
        if self.fixed is None and edit is None:
            return x
        if edit is not None:
            self.check(edit)
        forward = Forward({target.name: (views.apply(read, view), target)
                           for (target, view), read in zip(self.reads, reads)})
        value = views.apply(x, self.view)  # edits see the value as it is served
        for change in (self.fixed, edit):
            if change is not None:
                value = apply_edit(change, value, self.target, forward)
        return views.undo(value, self.view)


class InsertEditSlots(BuildPass):
    """Put each slot of the request after its value's node and rewire that node's readers to it; the
    slots become submodules of the graph module, and each value's slot node goes to
    ``build.slot_nodes`` (tap those to capture the edited value).

    A module port's slot feeds only that module (the marker's readers); a standard value's slot
    feeds every reader of the tensor, so e.g. an edit of ``layer_mid`` reaches both the MLP and the
    residual add.

    Slots at one tensor (a block's output is the next block's input) chain in catalogue order, the
    first nearest the tensor: an edit of ``layers.2.layer_input`` applies after one of
    ``layers.1.layer_output``, and each name is captured with the edits of the names before it (a
    value's marker reads the slots placed before it, so its own slot goes after them)."""

    markers = True

    def call(self, graph_module) -> PassResult:
        graph, catalogue = graph_module.graph, self.build.program.catalogue
        placed: dict[str, list] = {}  # {name: its slot's nodes}
        order = {name: index for index, name in enumerate(catalogue)}
        slots = self.build.request.slots
        for name in sorted(slots, key=order.__getitem__):
            slot, entry = slots[name], catalogue[name]
            location = entry.found  # made (MakeOnRequest) before the slots go in
            node = location.node
            if entry.spec is not None:  # a standard value: the tensor itself, not one module's view of it
                while node.target is MARK_OP:
                    node = node.args[0]
            graph_module.add_submodule(name_of(name), slot)
            for point in location.probes or (node,):  # edited inside a kernel: at its probes
                readers = list(point.users)
                with graph.inserting_after(point):
                    slot_node = graph.call_module(name_of(name), (point,))
                slot_node.meta["val"] = point.meta.get("val")
                for reader in readers:
                    reader.replace_input_with(point, slot_node)
                placed.setdefault(name, []).append(slot_node)
            self.build.slot_nodes[name] = node if location.probes else slot_node
        self._wire_reads(graph, placed)
        return PassResult(graph_module, bool(self.build.request.slots))

    def _wire_reads(self, graph, placed: dict[str, list]) -> None:
        """Give each slot node the values its slot reads (each as edited where it has a slot of its own; the
        value's own node where a slot reads the value it edits), refusing a read computed after it."""
        catalogue, slot_nodes = self.build.program.catalogue, self.build.slot_nodes
        order = {node: index for index, node in enumerate(graph.nodes)}
        for name, nodes in placed.items():
            slot = self.build.request.slots[name]
            for slot_node in nodes:
                reads = []
                for read in slot.read_names:
                    node = slot_nodes[read] if read in slot_nodes and read != name else catalogue[read].found.node
                    if read == name:
                        node = slot_node.args[0]
                    if order[node] >= order[slot_node]:
                        raise EditError(f"the edit at '{name}' reads '{read}', which the forward computes after "
                                        f"'{name}': an edit reads only values computed before the value it edits "
                                        f"(an earlier block's, or an earlier value of its own block)")
                    reads.append(node)
                slot_node.args = (slot_node.args[0], *reads)


def name_of(value: str) -> str:
    """The submodule name of a value's slot (``layers.3.layer_output`` -> ``edit__layers_3_layer_output``)."""
    return "edit__" + value.replace(".", "_")
