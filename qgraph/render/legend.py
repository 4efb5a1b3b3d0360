"""The legend under a diagram: one row per kind of box it draws that a reader needs told about."""
from __future__ import annotations

from .diagram import Diagram

TAPS = (("tap", "a standard value: name [layout]"), ("tap_value", "instrumented: ig.values"),
        ("tap_edit", "edit slot: ig.slots"))


def legend(diagram: Diagram, rows, always=()) -> list[tuple[str, str]]:
    """The ``(box kind, text)`` rows whose kind ``diagram`` draws, and those in ``always``."""
    kinds = {box.kind for box in diagram.boxes.values()}
    return [(kind, text) for kind, text in rows if kind in always or kind in kinds]
