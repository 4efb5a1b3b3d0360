"""The shape of a pass, the build context a program's passes share, and the one runner.

A pass is a ``torch.fx.passes.infra.pass_base.PassBase``: called on a graph module it runs
``requires``, ``call`` and ``ensures`` and returns a ``PassResult(graph_module, modified)``.
``run_passes`` runs a list in order, lints the graph after each, and when one fails says which, and
which ran before it (a note on the error, whose type and message stay the pass's own).

The passes that build a program (``passes.pipeline.PIPELINE``) are ``BuildPass``es: each is made
from the ``Build`` of one request (what was asked: ``Request``) and reads its inputs from it and
writes what it finds there for the passes after it, never on itself. Each says whether it reads the
port markers (it runs before ``StripMarkers``) or runs after they are gone; ``requires`` checks it.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..errors import InternalError
from ..kernels.ops import MARK_OP

if TYPE_CHECKING:  # types only
    from ..families.base import Family
    from ..values.catalogue import Entry


class Program(Protocol):
    """What a pass reads and changes of the program it builds (``qgraph.program.Program``, which imports
    the passes: named here by what it has, so the passes import nothing above them)."""

    model: Any
    family: Family
    module: GraphModule
    catalogue: dict[str, Entry]
    slots: dict[str, Any]  # {name: passes.edit.EditSlot}
    spliced: dict[str, Node]
    device: Any  # torch.device | None

    @property
    def graph(self) -> Graph: ...

    def add_input(self, name: str, source: Any, example: Any, recipe: dict | None = None) -> Node: ...

    def recatalogue(self) -> None: ...

    def sources_of(self, entry: Entry) -> list[str]: ...

__all__ = ["Build", "BuildPass", "GraphPass", "PassResult", "Request", "run_passes"]


class GraphPass(PassBase):
    """A qgraph pass: subclasses implement ``call(graph_module) -> PassResult``."""

    def __repr__(self) -> str:
        return type(self).__name__


@dataclass
class Request:
    """What one program is built for: the values to tap, the edit slots (``{name: EditSlot}``), whether
    it returns the logits, per-value options (states' positions, heads, dtype; ``grad``), the cached
    step to make (None, or ``"prompt"`` / ``"decode"``: ``passes.decode.OpenCache``), more values to
    make on request (the memory a cached step carries) and the transcoders of a replacement model
    (``{block: Transcoder}``: ``passes.replacement.Replacement``)."""

    values: list[str]
    slots: dict = field(default_factory=dict)
    logits: bool = True
    options: dict[str, dict] = field(default_factory=dict)
    cache: str | None = None
    make: tuple[str, ...] = ()
    replacement: dict | None = None


@dataclass
class Build:
    """One build of a program: the program being rewritten (its graph, catalogue, ``add_input``), the
    request, and what the passes hand on: each slot's node (``InsertEditSlots``), the outputs a pass
    adds (the memory a cached step taps: ``OpenCache``; the replacement model's: ``Replacement``) and the
    names tapped, in output order (``Tap``)."""

    program: Program
    request: Request
    slot_nodes: dict[str, Node] = field(default_factory=dict)
    taps: dict = field(default_factory=dict)  # {name: Found}: more outputs a pass adds (a cached step's memory)
    tapped: list[str] = field(default_factory=list)


class BuildPass(GraphPass):
    """A pass of the program pipeline, made from a ``Build``. ``markers``: True when it reads the port
    markers (it must run before they are stripped), False when it must run after, None when either."""

    markers: ClassVar[bool | None] = None

    def __init__(self, build: Build):
        self.build = build

    @classmethod
    def wanted(cls, build: Build) -> bool:
        """Whether this build runs the pass (a cached step's pass only for generation, ...)."""
        return True

    def requires(self, graph_module: GraphModule) -> None:
        if graph_module is not self.build.program.module:  # what it rewrites through the program (add_input)
            raise InternalError(f"{self!r} was given another graph module than its build's program's")
        if self.markers is not None and has_markers(graph_module) != self.markers:
            raise InternalError(f"{self!r} runs {'before' if self.markers else 'after'} the port markers are "
                                f"stripped, but the graph {'has none' if self.markers else 'still has them'}: the "
                                f"pipeline's order is broken")


def has_markers(graph_module: GraphModule) -> bool:
    """Whether the graph still holds port markers (``qgraph::mark``)."""
    return bool(graph_module.graph.find_nodes(op="call_function", target=MARK_OP))


def run_passes(module: GraphModule, passes: list[PassBase], done: list[str] | None = None) -> GraphModule:
    """Run ``passes`` in order on ``module`` and lint the graph after the last; return the final graph
    module. ``done`` is the history of passes already run on ``module`` (a program's, so that a failure
    names every pass before it); each pass run is added. (One lint, not one per pass: a lint walks every
    node, a few milliseconds of each new program on the 0.8B shape; a broken graph still fails before it
    runs, its note naming the passes that ran.)"""
    done = [] if done is None else done
    for graph_pass in passes:
        try:
            result = graph_pass(module)
            if result is not None:
                module = result.graph_module
        except Exception as error:
            _note(error, f"in pass {graph_pass!r}, after {', '.join(done) or 'no other pass'}")
            raise
        done.append(repr(graph_pass))
    try:
        module.graph.lint()
    except Exception as error:
        _note(error, f"the graph fails its lint after the passes {', '.join(done)}")
        raise
    return module


def _note(error: Exception, note: str) -> None:
    if sys.version_info >= (3, 11):  # add_note is 3.11's; on 3.10 the error goes up as it is
        error.add_note(f"qgraph: {note}")
