"""The checks of untrusted JSON fields, held once: a saved program's ``qgraph.json`` and ``graph.json``
(``saved.schema``), a function edit's data (``serve.function``), a server call's fields (``serve.request``,
``serve.edits``) and its body's safetensors header (``serve.wire``).

Each predicate says whether a value is what a field holds. Every one is false, never raising, on a value
of any other type (a list where a name goes, a dict where an int goes), and none takes a bool for a number
(JSON's ``true`` is Python's ``1``), NaN or an infinity for a float, or a text past its bound. ``Fields``
reads one JSON object by them: a missing, unknown or wrong field is refused with the caller's error class
(``SavedProgramError`` for files and function edits, the server's 400/422 errors for a call), its message
naming where, the field, what it holds and (bounded, escaped) what it was given.
"""
from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Collection
from typing import Any, NoReturn

import torch

from ..errors import SavedProgramError

Check = Callable[[Any], bool]
TEXT = 4096  # characters of a text field unless it says otherwise
DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))  # float32, half...
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxstring, _SHOWN.maxother = 3, 6, 6, 60, 60


def shown(value) -> str:
    """``value`` as a message shows it: a short repr, its strings escaped (no newline or terminal code
    of the sender's reaches a log), its containers cut, at once whatever their size."""
    return _SHOWN.repr(value)[:100]


# -- the predicates ---------------------------------------------------------------------------------


def flag(value) -> bool:
    """``true`` or ``false``."""
    return isinstance(value, bool)


def integer(low: float = -math.inf, high: float = math.inf) -> Check:
    """An int (never a bool) from ``low`` to ``high``."""
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def number(bound: float = math.inf) -> Check:
    """A finite real number, an int or a float (never a bool, NaN or an infinity), of magnitude below ``bound``."""
    return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and -bound < value < bound


def text(high: int = TEXT, low: int = 1, *, printable: bool = False) -> Check:
    """A str of ``low`` to ``high`` characters (with ``printable``, none a control or separator but space)."""
    return lambda value: isinstance(value, str) and low <= len(value) <= high and (not printable or value.isprintable())


def identifier(high: int = TEXT) -> Check:
    """A Python identifier of at most ``high`` characters (a class, a dim, an attribute's name)."""
    return lambda value: isinstance(value, str) and len(value) <= high and value.isidentifier()


def one_of(names: Collection[str]) -> Check:
    """One of ``names`` (a str: ``1`` is no name, ``True`` never the key ``1``, a list never hashed)."""
    return lambda value: isinstance(value, str) and value in names


def dtype_name(value) -> bool:
    """The name of a torch dtype, as ``str(dtype)`` or without its ``torch.``: ``float32``, ``torch.bfloat16``."""
    return isinstance(value, str) and value.removeprefix("torch.") in DTYPES


def optional(check: Check) -> Check:
    """``null`` or what ``check`` takes."""
    return lambda value: value is None or check(value)


def either(*checks: Check) -> Check:
    """What one of ``checks`` takes."""
    return lambda value: any(check(value) for check in checks)


def list_of(check: Check, low: int = 0, high: float = math.inf, *, distinct: bool = False) -> Check:
    """A list of ``low`` to ``high`` items (its length checked before its items), each taken by ``check``
    (with ``distinct``, no two equal)."""
    return lambda value: isinstance(value, list) and low <= len(value) <= high and all(map(check, value)) and \
        (not distinct or len(set(value)) == len(value))


def dict_of(check: Check, key: Check | None = None, high: float = math.inf) -> Check:
    """An object of at most ``high`` entries, each key taken by ``key`` (by default a text), each value by
    ``check``."""
    key = key or text()
    return lambda value: isinstance(value, dict) and len(value) <= high and all(
        key(name) and check(item) for name, item in value.items())


def record(checks: dict[str, Check]) -> Check:
    """An object of exactly the keys of ``checks``, each value taken by its check."""
    return lambda value: isinstance(value, dict) and set(value) == set(checks) and all(
        check(value[name]) for name, check in checks.items())


def tensor_shape(dims: int, size: int) -> Check:
    """A tensor's shape: at most ``dims`` sizes, each an int from 0 to ``size``."""
    return list_of(integer(0, size), high=dims)


# -- the reader -------------------------------------------------------------------------------------

_REQUIRED = object()


class Fields:
    """The fields of one untrusted JSON object ``data``, read by the predicates above; a refusal is an
    ``error`` (the caller's class) whose message starts with ``where`` and names the field.

    With ``keys`` a field outside them is refused at once (an ``unknown`` error, ``error`` unless given:
    the server answers an unknown key of a call 400, not the format, and a wrong value 422); with
    ``exact`` the object holds every one of them too. ``data`` that is no object is refused the same way."""

    def __init__(self, data, where: str, error: type[Exception] = SavedProgramError, *,
                 keys: Collection[str] | None = None, exact: bool = False, unknown: type[Exception] | None = None):
        self.data, self.where, self.error = data, where, error
        holds = "" if keys is None else f" of {'exactly the fields' if exact else 'fields among'} " \
                                        f"{', '.join(sorted(keys))}"
        if not isinstance(data, dict):
            raise error(f"{where} is not an object{holds}: {shown(data)}")
        if keys is None:
            return
        extra, missing = sorted(map(str, set(data) - set(keys))), sorted(set(keys) - set(data))
        if extra:
            raise (unknown or error)(f"{where} is not an object{holds}: it holds {shown(extra)} too")
        if exact and missing:
            raise error(f"{where} is not an object{holds}: it lacks {shown(missing)}")

    def fail(self, field: str, why: str) -> NoReturn:
        """Refuse ``field``: ``why`` says what is wrong with it."""
        raise self.error(f"{self.where}: its field {field!r} {why}")

    def refuse(self, why: str) -> NoReturn:
        """Refuse the object for ``why`` (a reason of no one field)."""
        raise self.error(f"{self.where}: {why}")

    def get(self, field: str, check: Check, what: str, default: Any = _REQUIRED) -> Any:
        """The value of ``field`` if ``check`` takes it (``what`` says what it holds, for the refusal);
        ``default`` when it is missing, if given (unchecked: the caller's own)."""
        if field not in self.data:
            if default is _REQUIRED:
                self.fail(field, f"is missing (it holds {what})")
            return default
        value = self.data[field]
        if not check(value):
            self.fail(field, f"is not {what}: {shown(value)}")
        return value
