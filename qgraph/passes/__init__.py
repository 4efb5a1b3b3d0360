"""Graph passes: each takes an fx graph and returns (or rewrites) it.

``locate`` finds the node of each value, ``decompose`` turns a fused sdpa node into explicit
ops, ``edit`` inserts edit slots, ``tap`` makes nodes outputs, ``markers`` strips the export-time
port markers.
"""
from .decompose import decompose_sdpa
from .locate import Found, Locator, Missing, OnRequest
from .markers import strip_markers
from .tap import tap

__all__ = ["Found", "Locator", "Missing", "OnRequest", "decompose_sdpa", "strip_markers", "tap"]
