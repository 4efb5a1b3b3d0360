"""The edit slots of one instrument: those it declares (with their fixed edits), those made for per-call
edits, and what a call's edits ask of them.

A slot is made once per value and per set of values it reads (``passes.edit.EditSlot``: what the edits'
``Read``s, ``Edit(reads=...)`` and relative steering read of the forward are its inputs), then kept. A
program is keyed by its slots (``key``), so a call whose edits read more of the forward runs a program
with those reads wired in, built once."""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from .edits import Region, needs
from .errors import EditError, InvalidType
from .passes.edit import EditSlot


class Slots:
    """The slots of one instrument over its ``catalogue``, names resolved by ``resolve``: ``declared``
    (``{name: EditSlot}``) from ``edits`` (a list of names, or a dict ``{pattern: fixed edit}``)."""

    def __init__(self, catalogue: dict, resolve: Callable[[object], list[str]], edits, lock: threading.RLock):
        self.catalogue, self.resolve, self._lock = catalogue, resolve, lock
        fixed = {name: self.bind(edit) for pattern, edit in edits.items() for name in resolve(pattern)} \
            if isinstance(edits, Mapping) else {}
        self.declared: dict[str, EditSlot] = {name: self._new(name, fixed.get(name), needs(fixed.get(name)))
                                              for name in resolve(edits)}
        self.main = frozenset((name, slot.read_names) for name, slot in self.declared.items())
        self._made: dict[tuple, EditSlot] = {}  # {(name, reads): slot} for per-call edits

    def _new(self, name: str, fixed=None, reads=()) -> EditSlot:
        return EditSlot.at(self.catalogue[name], fixed, [self.catalogue[read] for read in reads])

    def get(self, name: str, reads: tuple = ()) -> EditSlot:
        """The slot at ``name`` that reads ``reads`` (and what its fixed edit reads): declared, or made for
        per-call edits (once, then reused)."""
        declared = self.declared.get(name)
        wanted = tuple(dict.fromkeys([*(declared.read_names if declared else ()), *reads]))
        if declared is not None and wanted == declared.read_names:
            return declared
        with self._lock:
            if (name, wanted) not in self._made:
                self._made[(name, wanted)] = self._new(name, declared and declared.fixed, wanted)
            return self._made[(name, wanted)]

    def key(self, extra: Mapping[str, tuple] | None = None) -> frozenset:
        """The slots of a program with ``extra`` (``{name: what its call's edit reads}``) beside the declared
        ones: ``{(name, reads)}``."""
        if not extra:
            return self.main
        names = dict.fromkeys([*self.declared, *extra])
        return frozenset((name, self.get(name, extra.get(name, ())).read_names) for name in names)

    def bind(self, edit):
        """``edit`` with the values it reads (``Read``s, ``Edit(reads=...)``) named by their standard names."""
        return edit.bind(self.read_name) if isinstance(edit, Region) else edit

    def read_name(self, written: str, edit) -> str:
        """The one value ``written`` names, for an edit that reads it; an ``EditError`` otherwise."""
        names = self.resolve(written)
        if len(names) != 1:
            raise EditError(f"{type(edit).__name__} reads '{written}', which names {len(names)} values "
                            f"({', '.join(names[:4])}{' ...' if len(names) > 4 else ''}): a read names one value")
        entry = self.catalogue[names[0]]
        if entry.derived:
            raise EditError(f"{type(edit).__name__} reads '{names[0]}', which is computed after the run from other "
                            f"values ({entry.description}); read a value of the forward")
        return names[0]

    def of_call(self, edits: Mapping | None) -> dict[str, object]:
        """``{name: edit}`` for a call's ``edits={pattern: edit}``, patterns resolved, each name checked
        to be editable (a later pattern overrides an earlier one at the same name), the values each edit
        reads named (``bind``)."""
        if edits is None:
            return {}
        if not isinstance(edits, Mapping):
            raise InvalidType(f"edits= takes a dict {{name: edit}}, not {type(edits).__name__}: e.g. "
                              f"edits={{'layers.2.layer_output': qgraph.Zero()}}")
        resolved = {}
        for pattern, edit in edits.items():
            bound = self.bind(edit)
            for name in self.resolve(pattern):
                self.get(name, needs(bound)).check(bound)  # it can be edited, so
                resolved[name] = bound
        return resolved
