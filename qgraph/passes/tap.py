"""Make the values asked for outputs of the program, and drop what no output needs."""
from __future__ import annotations

from ..kernels import views
from .base import BuildPass, PassResult
from ..values.locate import Found, gradient_node


class Tap(BuildPass):
    """Append each value the build taps to the program's outputs (a value with a ``view`` as that view
    of its node) and keep, of the model's own outputs, the logits (its first) or none. What it taps:
    the values asked (at their slot where they have one), the sources of the derived ones, the tensor
    a ``{"grad": True}`` value's readers read (``grad_tap(name)``) and a cached step's memory. Writes
    the tapped names, in output order, to ``build.tapped``."""

    markers = True

    def call(self, graph_module) -> PassResult:
        found = self.found()
        graph = graph_module.graph
        output = graph.output_node()
        model_outputs = tuple(output.args[0])
        taps = tuple(views.emit(graph, location.node, location.view) for location in found.values())
        kept = (model_outputs[0],) if self.build.request.logits else ()
        output.args = (kept + taps,)
        self.build.tapped = list(found)
        return PassResult(graph_module, True)

    def found(self) -> dict[str, Found]:
        build, request = self.build, self.build.request
        program, catalogue = build.program, build.program.catalogue
        wanted = [name for name in request.values if not catalogue[name].derived]
        for name in request.values:
            if catalogue[name].derived:
                wanted += [source for source in program.sources_of(catalogue[name]) if source not in wanted]
        found: dict[str, Found] = {}
        for name in wanted:  # each made (MakeOnRequest) by now
            location = catalogue[name].found
            found[name] = Found(build.slot_nodes[name], location.view) if name in build.slot_nodes else location
        for name in request.values:
            if request.options.get(name, {}).get("grad"):
                probes = catalogue[name].found.probes
                found[grad_tap(name)] = Found(gradient_node(Found(found[name].node, (), probes)))
        return {**found, **build.taps}


class Prune(BuildPass):
    """Drop every node no output needs (and the model's own work past the last value tapped). Edit
    slots are pure: an unread one goes too."""

    markers = False

    def call(self, graph_module) -> PassResult:
        modified = graph_module.graph.eliminate_dead_code(
            is_impure_node=lambda node: node.op != "call_module" and node.is_impure())
        if modified:
            graph_module.delete_all_unused_submodules()
        return PassResult(graph_module, modified)


def grad_tap(name: str) -> str:
    """The hidden output holding the tensor a ``grad`` value's readers read (before its view)."""
    return f"{name}#grad"
