"""The rewrites that make a value the exported graph does not hold as a node, as typed objects.

``Locator`` answers ``OnRequest(node, rewrite)`` for such a value; ``passes.make.MakeOnRequest`` (the
pass the program builder runs for every value asked for) calls ``rewrite.apply``. Each rewrite says, in
``note``, what asking for the value does (the diagrams show it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.fx import Node

from ..errors import OutOfRange
from ..kernels.experts import DOWN_OP, NEURONS_OP
from .context import open_padding
from .decompose import decompose_sdpa
from .emit import emitter
from .swap import open_conv_context, read_as_attention, swap_for_states, swap_for_writes


class Rewrite:
    """Makes a value by rewriting the graph around ``node``; one rewrite per node serves every value
    it makes (a block's scores and probabilities)."""

    note = "a pass makes it when it is asked for"
    replaces_node = True  # the rewrite erases ``node``: the build applies those after the ones that read it

    def apply(self, program, node: Node, name: str, option: dict) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class DecomposeSdpa(Rewrite):
    """A block's attention pattern under sdpa: its sdpa node becomes explicit ops (``rewrites.decompose``)."""

    note = "asking for it decomposes the fused sdpa into q·kᵀ, softmax and ·v (this block only)"

    def apply(self, program, node, name, option):
        decompose_sdpa(program.graph, node)


@dataclass(frozen=True)
class SwapForStates(Rewrite):
    """A DeltaNet block's states: its kernel becomes the state-emitting one (``rewrites.swap``), at
    every token or at the ``positions`` option's tokens, for the ``heads`` option's heads."""

    at_positions: bool

    @property
    def note(self):
        return ("asking for it swaps the kernel for one that returns the state at the positions asked for"
                if self.at_positions else "asking for it swaps the kernel for one that returns the state after "
                                          "every token")

    def apply(self, program, node, name, option):
        positions, heads = option.get("positions"), option.get("heads")
        if positions is not None:
            recipe = {"kind": "positions", "value": name, "positions": [int(p) for p in positions]}
            positions = program.add_input(f"{name}.positions", input_source(recipe),
                                          torch.zeros(len(positions), dtype=torch.long), recipe)
        if heads is not None:
            recipe = {"kind": "heads", "heads": [int(h) for h in heads]}
            heads = program.add_input(f"{name}.heads", input_source(recipe), torch.tensor(heads), recipe)
        swap_for_states(program.graph, node, positions, heads, option.get("dtype", torch.float32))


@dataclass(frozen=True)
class ReadAsAttention(Rewrite):
    """A DeltaNet block's effective attention and initial-state output: a node beside its kernel that
    runs the rule on one-hot values (``rewrites.swap.read_as_attention``)."""

    note = "asking for it adds a node beside the kernel that runs the delta rule on one-hot values"
    replaces_node = False

    def apply(self, program, node, name, option):
        read_as_attention(program.graph, node)


@dataclass(frozen=True)
class SwapForWrites(Rewrite):
    """A DeltaNet block's writes: its kernel becomes one that returns each token's write and takes an
    edit of it inside the recurrence (``rewrites.swap.swap_for_writes``)."""

    note = "asking for it swaps the kernel for one that returns each token's write and edits it in the recurrence"

    def apply(self, program, node, name, option):
        swap_for_writes(program.graph, node)


@dataclass(frozen=True)
class OpenConvContext(Rewrite):
    """A DeltaNet block's conv context: its causal conv gets an explicit left context (``rewrites.swap``)."""

    note = "asking for it opens the causal conv to read the context it pads with"

    def apply(self, program, node, name, option):
        open_conv_context(program.graph, node)


@dataclass(frozen=True)
class OpenPadding(Rewrite):
    """A padded sequence's left context: the padding gets an explicit context (``rewrites.context``)."""

    note = "asking for it opens the padding before the sequence into a context of its own"

    def apply(self, program, node, name, option):
        open_padding(program.graph, node)


@dataclass(frozen=True)
class SplitExperts(Rewrite):
    """A MoE block's experts' neurons: its ``qgraph::moe_experts`` call becomes the neurons op and the
    down-projection op (``kernels.experts``), the neurons a node between them. The pair runs the eager
    experts loop whatever implementation the op named (its last argument, dropped)."""

    note = "asking for it splits the experts op into neurons and their weighted down projections"

    def apply(self, program, node, name, option):
        hidden, indices, expert_weights, gate_up_proj, down_proj, activation = node.args[:6]
        emit = emitter(program.graph, node)
        with program.graph.inserting_before(node):
            neurons = emit(NEURONS_OP, hidden, indices, gate_up_proj, activation)
            out = emit(DOWN_OP, neurons, indices, expert_weights, down_proj)
        node.replace_all_uses_with(out)
        program.graph.erase_node(node)


def input_name(name: str) -> str:
    """A program input's placeholder name for a value's option (``layers.0.linear_attn.state.positions``)."""
    return re.sub(r"\W", "_", name)


def input_source(recipe: dict):
    """The function of a call's inputs that an input added for a value's options computes (its
    ``recipe``: states' positions, resolved against the call's length, or heads)."""
    if recipe["kind"] == "positions":
        return _positions(recipe["value"], recipe["positions"])
    heads = torch.tensor(recipe["heads"])
    return lambda inputs: heads


def _positions(name: str, positions):
    """A function of the call's inputs giving ``positions`` as indices into its tokens."""
    positions = [int(p) for p in positions]

    def source(inputs):
        seq = inputs["input_ids"].shape[1]
        bad = [p for p in positions if not -seq <= p < seq]
        if bad:
            raise OutOfRange(f"'{name}' positions {bad} are out of range for a call of {seq} tokens")
        return torch.tensor([p % seq for p in positions])
    return source
