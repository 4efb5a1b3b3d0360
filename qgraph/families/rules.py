"""The vocabulary a family is written in: which rule finds which value.

A rule says *where* a value lives, relative to the module that hosts it; ``passes.locate`` knows
*how* to find each kind of rule in an exported graph (by module scope and op pattern).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Port:
    """A module's first input or its output (what a forward pre-hook or hook would read).

    ``module`` is relative to the host ("" is the host itself), or a full module name with
    ``absolute``. ``view`` is how the value is served from the module's tensor, as steps:
    ``("heads", "num_heads", "head_dim")`` unflattens the last axis into heads, ``("batch1",)`` adds
    a leading axis of 1 (the vision tower's packed ``[patches, width]`` as ``[1, patches, width]``).
    """

    module: str
    side: str  # "input" or "output"
    view: tuple = ()
    absolute: bool = False


HEADS = (("heads", "num_heads", "head_dim"),)
BATCH1 = (("batch1",),)


@dataclass(frozen=True)
class DeltaRule:
    """An argument or output of the host's gated delta-rule kernel node."""

    part: str  # queries keys values decays betas state_input | head_outputs state_output

    ARGUMENTS = ("queries", "keys", "values", "decays", "betas", "state_input")
    OUTPUTS = ("head_outputs", "state_output")


@dataclass(frozen=True)
class DeltaRuleStates:
    """The host's recurrent state after every token (``positions=False``) or after chosen tokens:
    made on request by swapping the kernel node for the state-emitting op (``passes.swap``)."""

    at_positions: bool


@dataclass(frozen=True)
class ConvContext:
    """The left context of the host's causal conv (``input``: what it starts from, zeros at a
    prompt's start; ``output``: its last columns, the next call's context): made on request by
    giving the conv an explicit context (``passes.swap.open_conv_context``)."""

    side: str  # "input" | "output"


@dataclass(frozen=True)
class Attention:
    """A tensor of the host's attention core: the sdpa node, or the eager softmax pattern."""

    part: str  # queries keys values scores probabilities head_outputs


@dataclass(frozen=True)
class Routing:
    """A routing tensor of the host's sparse MoE block, found from its ``qgraph::moe_experts`` call:
    ``indices`` and ``expert_weights`` are the op's arguments, ``weights`` the top-k weights spread
    into ``expert_weights``, ``logits`` what the router's softmax reads, ``neurons`` the experts'
    neurons (made on request by splitting the op)."""

    part: str  # logits weights indices expert_weights neurons


@dataclass(frozen=True)
class ProjectionHalf:
    """One half of the per-head split of a projection's output (q_proj's query | gate halves)."""

    projection: str  # the projection module, relative to the host
    half: int  # 0 or 1


@dataclass(frozen=True)
class ProgramInput:
    """An input the program is called with."""

    name: str


@dataclass(frozen=True)
class ProgramOutput:
    """The program's own output (what the model returns)."""

    name: str


@dataclass(frozen=True)
class VarlenAttention:
    """An argument or the output of the host's packed per-image attention op (the vision tower)."""

    part: str  # queries keys values | head_outputs

    ARGUMENTS = ("queries", "keys", "values")


@dataclass(frozen=True)
class ScatterSource:
    """What ``masked_scatter`` writes into the text embeddings (the image features)."""


@dataclass(frozen=True)
class Derived:
    """A read-only value computed after the run from other values (``{host}`` is the host's name)."""

    sources: tuple[str, ...]
    how: str  # a function name in ``qgraph.values.derive``


@dataclass(frozen=True)
class SAEPart:
    """A value of a sparse autoencoder spliced at another value (``qgraph.saes``): its ``features``,
    ``reconstruction`` or ``error``. Not in a family's table: ``values.saes`` makes these entries."""

    part: str


@dataclass(frozen=True)
class ValueSpec:
    """One standard value: its name on its host, layout, description and the rule that finds it."""

    name: str
    host: str  # a key of the family's HOSTS: "model", "layer", "mlp", a mixer, "vision", "vision_layer", ...
    layout: str  # "Residual [batch seq hidden_size]": a kind, then dims named after family dims
    description: str
    rule: object

    @property
    def dims(self) -> tuple[str, ...]:
        inside = self.layout[self.layout.index("[") + 1:self.layout.index("]")]
        return tuple(inside.split())

    @property
    def read_only(self) -> bool:
        return isinstance(self.rule, (ProgramInput, Derived, DeltaRuleStates)) or \
            (isinstance(self.rule, SAEPart) and self.rule.part != "features") or self.rule == Routing("indices")
