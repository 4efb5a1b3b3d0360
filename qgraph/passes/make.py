"""The pass that makes the on-request values a build needs, by their typed rewrites (``passes.on_request``)."""
from __future__ import annotations

from ..errors import InvalidArgument
from .base import BuildPass, PassResult
from .locate import OnRequest
from .on_request import SwapForStates


class MakeOnRequest(BuildPass):
    """Apply the rewrite of each on-request value the build needs (``requested``), once per node, then
    catalogue the program again (a decomposed block's pattern is now found)."""

    markers = True

    def __init__(self, build):
        super().__init__(build)
        self.requests = requested(build)

    @classmethod
    def wanted(cls, build) -> bool:
        return bool(requested(build))

    def __repr__(self) -> str:
        return f"MakeOnRequest({', '.join(self.requests)})"

    def requires(self, graph_module) -> None:
        super().requires(graph_module)
        by_node = {}
        for name, request in self.requests.items():
            other = by_node.setdefault(request.node, name)
            if other != name and isinstance(request.rewrite, SwapForStates):
                raise InvalidArgument(f"'{other}' and '{name}': ask a block for states (every token) or state (at "
                                 f"positions), not both; states[:, positions] is the same")

    def call(self, graph_module) -> PassResult:
        done, program, options = set(), self.build.program, self.build.request.options
        for name, request in self.requests.items():
            if request.node not in done:  # scores and probabilities (or both conv sides) of one block: one rewrite
                done.add(request.node)
                request.rewrite.apply(program, request.node, name, options.get(name, {}))
        program.recatalogue()
        return PassResult(graph_module, bool(done))


def requested(build) -> dict:
    """``{name: OnRequest}`` of the on-request values a build needs made: the values asked, the slots
    and the request's ``make`` (a cached step's memory, the SAEs that change what the model reads)."""
    program, request = build.program, build.request
    names = [*request.values, *request.slots, *request.make]
    return {name: program.catalogue[name].location for name in names
            if name in program.catalogue and isinstance(program.catalogue[name].location, OnRequest)}
