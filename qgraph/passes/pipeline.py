"""The passes that build a program, in the order they run: one list, read top to bottom.

Each entry is a ``BuildPass`` class (``passes.base``). ``build_passes(build)`` makes the ones the
build wants (``wanted``) from it, and ``Program.build`` runs them once, in this order, through the one
runner (``run_passes``: a failure names the pass and those before it; the graph is linted after the last). Each pass
reads what it needs from the ``Build`` and leaves there what the passes after it read; the port
markers are read up to ``StripMarkers`` and gone after it (each pass's ``requires`` checks which).
A diagram runs the first entry alone (``Program.make``): the graph it draws is the program's.
"""
from __future__ import annotations

from .base import Build, BuildPass
from .decode import OpenCache
from .device import OnDevice
from .edit import InsertEditSlots
from .make import MakeOnRequest
from .markers import StripMarkers
from .replacement import Replacement
from .tap import Prune, Tap

PIPELINE: tuple[type[BuildPass], ...] = (
    MakeOnRequest,    # make the on-request values asked (decompose sdpa, swap a kernel for states, open a
                      # conv, split the experts, splice an SAE), then catalogue the program again
    OpenCache,        # generation only: the prompt program becomes a cached step, its memory explicit
    Replacement,      # attribution only: transcoders at every MLP, the model frozen around them
    InsertEditSlots,  # a slot after each value the request edits       -> build.slot_nodes
    Tap,              # the values asked, derived values' sources, grads and memory become outputs
                      #                                                 -> build.tapped
    StripMarkers,     # the port markers go
    Prune,            # what no output needs goes
    OnDevice,         # weights loaded on another device than the model's (meta): its devices follow
)


def build_passes(build: Build, pipeline=PIPELINE) -> list[BuildPass]:
    """The passes of ``pipeline`` that ``build`` wants, made from it, in order."""
    return [graph_pass(build) for graph_pass in pipeline if graph_pass.wanted(build)]
