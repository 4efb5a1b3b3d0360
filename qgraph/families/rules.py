"""The vocabulary a family is written in: which rule finds which value.

A rule says *where* a value lives, relative to the module that hosts it; ``values.locate`` knows
*how* to find each kind of rule in an exported graph (by module scope and op pattern).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


class Rule:
    """What every rule is, with its traits (class-level, or a property where they depend on a field):

    ``read_only``: its value can be read but not edited; ``by_name_only``: only its own name selects
    the value, never a glob (a value that rewrites its block when asked for); ``derived``: computed
    after the run from other values; ``region_edits_only``: an edit reaches it inside a kernel, as an
    affine map of each token's vector (``Replace``, ``Add``, ``Scale``, ``Zero``), so a function edit is
    refused. ``values.locate`` registers one locator per rule type
    (``@locates``)."""

    by_name_only: ClassVar[bool] = False
    derived: ClassVar[bool] = False
    region_edits_only: ClassVar[bool] = False  # edited as an affine map inside a kernel: no function edits

    @property
    def read_only(self) -> bool:
        """False here; a rule class sets it (a class-level True) or computes it from a field (a property)."""
        return False


@dataclass(frozen=True)
class Port(Rule):
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
STREAMS = (("heads", "streams", "hidden_size"),)  # hyper-connections' streams, side by side in one axis
BATCH1 = (("batch1",),)


@dataclass(frozen=True)
class DeltaRule(Rule):
    """An argument or output of the host's gated delta-rule kernel node."""

    part: str  # queries keys values decays betas state_input | head_outputs state_output

    ARGUMENTS = ("queries", "keys", "values", "decays", "betas", "state_input")
    OUTPUTS = ("head_outputs", "state_output")


@dataclass(frozen=True)
class DeltaRuleStates(Rule):
    """The host's recurrent state after every token (``positions=False``) or after chosen tokens:
    made on request by swapping the kernel node for the state-emitting op (``rewrites.swap``)."""

    read_only: ClassVar[bool] = True
    by_name_only: ClassVar[bool] = True  # swaps its block's kernel when asked for

    at_positions: bool


@dataclass(frozen=True)
class DeltaRuleReads(Rule):
    """The host's delta rule read as attention: its exact effective attention (``attention``, editable:
    the block then reads ``A' @ values`` plus the initial state's part) and what its initial state adds
    to its outputs (``initial_state``), made on request by a node beside the kernel that runs the rule
    on one-hot values (``rewrites.swap.read_as_attention``)."""

    by_name_only: ClassVar[bool] = True  # adds nodes to its block when asked for

    part: str  # attention | initial_state

    @property
    def read_only(self) -> bool:
        return self.part == "initial_state"


@dataclass(frozen=True)
class DeltaRuleWrites(Rule):
    """What each token writes into the host's state, made on request by swapping the kernel for one
    that returns the writes and takes an edit of them inside the recurrence (``rewrites.swap``)."""

    by_name_only: ClassVar[bool] = True  # swaps its block's kernel when asked for
    region_edits_only: ClassVar[bool] = True


@dataclass(frozen=True)
class ConvContext(Rule):
    """The left context of the host's causal conv (``input``: what it starts from, zeros at a
    prompt's start; ``output``: its last columns, the next call's context): made on request by
    giving the conv an explicit context (``rewrites.swap.open_conv_context``)."""

    by_name_only: ClassVar[bool] = True  # opens its block's conv when asked for

    side: str  # "input" | "output"


@dataclass(frozen=True)
class Attention(Rule):
    """A tensor of the host's attention core: the sdpa node, or the eager softmax pattern."""

    part: str  # queries keys values scores probabilities head_outputs


@dataclass(frozen=True)
class Routing(Rule):
    """A routing tensor of the host's sparse MoE block, found from its ``qgraph::moe_experts`` call:
    ``indices`` and ``expert_weights`` are the op's arguments, ``weights`` the top-k weights spread
    into ``expert_weights``, ``logits`` what the router's softmax reads, ``neurons`` the experts'
    neurons (made on request by splitting the op)."""

    part: str  # logits weights indices expert_weights neurons

    @property
    def read_only(self) -> bool:
        return self.part == "indices"


@dataclass(frozen=True)
class Applied(Rule):
    """What elementwise ops make of a module's port (the module's weights, activated inline): the port's
    node followed user by user through ``ops`` (aten op names, in order: ``("div", "sigmoid", "mul")``),
    the last one's output, served through ``view`` (``Port``'s)."""

    module: str  # relative to the host
    side: str  # "input" or "output"
    ops: tuple[str, ...]
    view: tuple = ()


@dataclass(frozen=True)
class Selection(Rule):
    """A tensor of the host's sparse-attention token selection, found from its ``qgraph::qsa_select``
    call (``kernels.qsa``): ``scores`` the block scores it reads, ``tokens`` the selection it returns;
    or from its ``qgraph::qsa_blocks`` call: ``keys`` the tokens' keys its blocks are made of."""

    part: str  # scores | tokens | keys


@dataclass(frozen=True)
class PaddedContext(Rule):
    """The left context a causal computation of the host reads before a call's first token, where the
    model pads the sequence with a constant (zeros before a conv, an id before n-gram hashes): ``input``
    the context (that constant at a prompt's start), ``output`` the last columns of the context and the
    call's own (the next call's context). ``module`` (relative to the host) is the module whose own ops
    pad: its first left padding (``pad``, or ``cat`` of a constant before the sequence). Made on request
    by giving the padding an explicit context (``rewrites.context.open_padding``)."""

    by_name_only: ClassVar[bool] = True  # opens its module's padding when asked for

    module: str
    side: str  # "input" | "output"


@dataclass(frozen=True)
class ProjectionHalf(Rule):
    """One half of the per-head split of a projection's output (q_proj's query | gate halves)."""

    projection: str  # the projection module, relative to the host
    half: int  # 0 or 1


@dataclass(frozen=True)
class ProgramInput(Rule):
    """An input the program is called with."""

    read_only: ClassVar[bool] = True

    name: str


@dataclass(frozen=True)
class ProgramOutput(Rule):
    """The program's own output (what the model returns)."""

    name: str


@dataclass(frozen=True)
class VarlenAttention(Rule):
    """An argument or the output of the host's packed per-image attention op (the vision tower)."""

    part: str  # queries keys values | head_outputs

    ARGUMENTS = ("queries", "keys", "values")


@dataclass(frozen=True)
class ScatterSource(Rule):
    """What ``masked_scatter`` writes into the text embeddings (the image features)."""


@dataclass(frozen=True)
class Derived(Rule):
    """A read-only value computed after the run from other values (``{host}`` is the host's name)."""

    read_only: ClassVar[bool] = True
    derived: ClassVar[bool] = True

    sources: tuple[str, ...]
    how: str  # the name of a function registered in ``qgraph.values.derive.DERIVATIONS``


@dataclass(frozen=True)
class SAEPart(Rule):
    """A value of a sparse autoencoder spliced at another value (``qgraph.saes``): its ``features``,
    ``reconstruction`` or ``error``. Not in a family's table: ``values.dictionaries`` makes these entries."""

    part: str

    @property
    def read_only(self) -> bool:
        return self.part != "features"


@dataclass(frozen=True)
class ValueSpec:
    """One standard value: its name on its host, layout, description and the rule that finds it."""

    name: str
    host: str  # a key of the family's HOSTS: "model", "layer", "mlp", a mixer, "vision", "vision_layer", ...
    layout: str  # "Residual [batch seq hidden_size]": a kind, then dims named after family dims
    description: str
    rule: Rule

    @property
    def dims(self) -> tuple[str, ...]:
        inside = self.layout[self.layout.index("[") + 1:self.layout.index("]")]
        return tuple(inside.split())

    @property
    def read_only(self) -> bool:
        return self.rule.read_only
