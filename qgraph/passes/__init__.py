"""Graph passes: each takes an fx graph and returns (or rewrites) it.

``locate`` finds the node of each value, ``tap`` makes nodes outputs, ``markers`` strips the
export-time port markers.
"""
from .locate import Found, Locator, Missing
from .markers import strip_markers
from .tap import tap

__all__ = ["Found", "Locator", "Missing", "strip_markers", "tap"]
