"""The vocabulary a family is written in: which rule finds which value.

A rule says *where* a value lives, relative to the module that hosts it; ``passes.locate`` knows
*how* to find each kind of rule in an exported graph (by module scope and op pattern).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Port:
    """A module's first input or its output (what a forward pre-hook or hook would read).

    ``module`` is relative to the host ("" is the host itself). ``split_heads`` names the config
    dims that unflatten the last axis into ``[heads, head_dim]`` (a view, for head layouts).
    """

    module: str
    side: str  # "input" or "output"
    split_heads: tuple[str, str] | None = None


@dataclass(frozen=True)
class DeltaRule:
    """An argument or output of the host's gated delta-rule kernel node."""

    part: str  # queries keys values decays betas state_input | head_outputs state_output

    ARGUMENTS = ("queries", "keys", "values", "decays", "betas", "state_input")
    OUTPUTS = ("head_outputs", "state_output")


@dataclass(frozen=True)
class Attention:
    """A tensor of the host's attention core: the sdpa node, or the eager softmax pattern."""

    part: str  # queries keys values scores probabilities head_outputs


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
class Derived:
    """A read-only value computed from another value after the run."""

    source: str
    how: str  # "last_position_softmax" | "size"


@dataclass(frozen=True)
class ValueSpec:
    """One standard value: its name on its host, layout, description and the rule that finds it."""

    name: str
    host: str  # "model", "layer", "mlp", or a mixer name ("linear_attn", "self_attn")
    layout: str  # "Residual [batch seq hidden_size]": a kind, then dims named after family dims
    description: str
    rule: object

    @property
    def dims(self) -> tuple[str, ...]:
        inside = self.layout[self.layout.index("[") + 1:self.layout.index("]")]
        return tuple(inside.split())

    @property
    def read_only(self) -> bool:
        return isinstance(self.rule, (ProgramInput, Derived))
