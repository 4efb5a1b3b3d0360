"""The shape of a pass and the one runner that runs them, as torch's pass infrastructure has it.

A pass is a ``torch.fx.passes.infra.pass_base.PassBase``: called on a graph module it runs
``requires``, ``call`` and ``ensures`` and returns a ``PassResult(graph_module, modified)``. What a
pass finds for the passes after it (the nodes it tapped, the slots it inserted) it keeps on itself.
``run_passes`` runs a list in order, lints the graph after each, and when one fails says which, and
which ran before it (a note on the error, whose type and message stay the pass's own).
"""
from __future__ import annotations

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase, PassResult

__all__ = ["GraphPass", "PassResult", "run_passes"]


class GraphPass(PassBase):
    """A qgraph pass: subclasses implement ``call(graph_module) -> PassResult``."""

    def __repr__(self) -> str:
        return type(self).__name__


def run_passes(module: GraphModule, passes: list[PassBase], done: list[str] | None = None) -> GraphModule:
    """Run ``passes`` in order on ``module``, linting after each; return the final graph module.
    ``done`` is the history of passes already run on ``module`` (a builder that runs its passes in
    steps passes its own list, so a failure names every pass before it); each pass run is added."""
    done = [] if done is None else done
    for graph_pass in passes:
        try:
            result = graph_pass(module)
            if result is not None:
                module = result.graph_module
            module.graph.lint()
        except Exception as error:
            error.add_note(f"qgraph: in pass {graph_pass!r}, after {', '.join(done) or 'no other pass'}")
            raise
        done.append(repr(graph_pass))
    return module
