"""The pass that makes the on-request values a build needs, by their typed rewrites (``rewrites.on_request``)."""
from __future__ import annotations

from torch.fx import Node

from ..errors import InvalidArgument
from .base import BuildPass, PassResult
from ..values.locate import OnRequest
from ..rewrites.on_request import SwapForStates, SwapForWrites


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
        by_node: dict[Node, str] = {}  # a kernel's node -> the first value that swaps it
        for name, request in self.requests.items():
            if not isinstance(request.rewrite, (SwapForStates, SwapForWrites)):
                continue
            other = by_node.setdefault(request.node, name)
            if other != name and isinstance(self.requests[other].rewrite, SwapForWrites) is not \
                    isinstance(request.rewrite, SwapForWrites):
                raise InvalidArgument(f"'{other}' and '{name}': a block's kernel returns its states or its writes, not "
                                      f"both; ask one per call (the state after token t is the decayed state before "
                                      f"it plus k_t write_t^T)")
            if other != name and request.rewrite != self.requests[other].rewrite:
                raise InvalidArgument(f"'{other}' and '{name}': ask a block for states (every token) or state (at "
                                 f"positions), not both; states[:, positions] is the same")

    def call(self, graph_module) -> PassResult:
        done, program, options = set(), self.build.program, self.build.request.options
        # those that read a node before those that erase it (a block's effective attention, then its writes)
        for name, request in sorted(self.requests.items(), key=lambda item: item[1].rewrite.replaces_node):
            if (request.node, request.rewrite) not in done:  # scores and probabilities of one block: one rewrite
                done.add((request.node, request.rewrite))
                request.rewrite.apply(program, request.node, name, options.get(name, {}))
        program.recatalogue()
        return PassResult(graph_module, bool(done))


def requested(build) -> dict:
    """``{name: OnRequest}`` of the on-request values a build needs made: the values asked, the slots
    and the request's ``make`` (a cached step's memory, the SAEs that change what the model reads)."""
    program, request = build.program, build.request
    reads = [read for slot in request.slots.values() for read in slot.read_names]
    names = [*request.values, *request.slots, *request.make, *reads]
    return {name: program.catalogue[name].location for name in names
            if name in program.catalogue and isinstance(program.catalogue[name].location, OnRequest)}
