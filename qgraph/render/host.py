"""The block diagram as its parts see it: ``_Block`` (``block.py``) mixes ``BlockGrouping``, ``BlockLabels``
and ``BlockTaps`` over ``Drawing``, and each part reads what another sets. ``BlockHost`` declares that shared
state, and the methods one part calls on another, once, so each part is checked against it."""
from __future__ import annotations

from abc import abstractmethod

from typing import TYPE_CHECKING

from torch.fx import Node

from .graph import GraphView
from .skeleton import Drawing

if TYPE_CHECKING:  # a type only: the catalogue's entries
    from ..values.catalogue import Entry


class BlockHost(Drawing):
    """The state of one block's diagram, by the part that sets it."""

    # _Block: which block, drawn how
    view: GraphView
    layer: int
    prefix: str
    detail: str
    vision: bool
    mixer: str | None  # None: the vision mixer of a family without images (never drawn)
    # BlockGrouping: the block's scopes, values, and (modules detail) what each node is
    scopes: set[str]
    leaves: set[str]
    residual_in: Node | None
    values: dict[str, Entry]
    kinds: dict[Node, str]
    const: dict[Node, bool]
    context: dict[Node, str]
    rotary: set[Node]
    value_roots: set[Node]
    # BlockTaps: the values no node holds, and the node each tap sits on
    ghosts: list[str]
    tap_nodes: dict[str, Node]

    @abstractmethod
    def _cluster_of(self, scope: str) -> str | None:
        ...  # _Block's

    @abstractmethod
    def _root(self, node: Node) -> Node:
        ...  # BlockGrouping's

    @abstractmethod
    def _context_kind(self, node: Node) -> str | None:
        ...  # BlockGrouping's

    @abstractmethod
    def _group_of(self, node: Node) -> tuple | None:
        ...  # BlockGrouping's
