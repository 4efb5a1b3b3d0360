"""Graph passes: the rewrites that build a program, in the order ``pipeline.PIPELINE`` lists them.

``locate`` finds the node of each value, ``on_request`` holds the typed rewrites that make a value
the graph does not hold (``make.MakeOnRequest`` applies them), ``decode`` makes a cached decoding
step, ``edit`` inserts edit slots, ``tap`` makes nodes outputs and drops dead code, ``markers``
strips the export-time port markers, ``device`` moves recorded devices. ``base`` has the pass shape,
the build context and the runner.
"""
from .decompose import decompose_sdpa
from .locate import Found, Locator, Missing, OnRequest

__all__ = ["Found", "Locator", "Missing", "OnRequest", "decompose_sdpa"]
