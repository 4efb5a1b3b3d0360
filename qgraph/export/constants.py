"""The Python values a model's forward reads, which ``torch.export`` bakes into the program.

A program holds every non-tensor the forward read while it was traced as a constant: a norm's
``eps``, an attention's ``scaling``, the rotary's ``attention_scaling``, config fields read in the
forward. Changing one afterwards makes the program stale. Which ones they are is not listed by
hand: ``recording(twin)`` watches the export itself. While it is active, every module and config
object of the traced twin answers attribute reads through a recording subclass of its own class
(same name, so the graph's module scopes do not change), and each read of a plain value (numbers,
strings, dtypes, and containers of them) is noted as ``(class, attribute)``. A read in a seed block
so stands for the same attribute of every block of that class (``qgraph.export.repeat``).

``current(model, reads)`` reads those attributes on every object of the model now: part of the
model's fingerprint (``qgraph.export.fingerprint``) and of the disk cache's check, so a change
rebuilds the program instead of serving a stale one. The classes are restored when the trace
ends; the model is left as it was.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

Read = tuple[str, str]  # (the class's module.qualname, the attribute)

_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _plain(value) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _plain(item) for key, item in value.items())
    return False


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def objects(root: torch.nn.Module) -> Iterator[tuple[str, object]]:
    """Every module of ``root`` and every config object its modules hold (sub-configs included),
    each once, with a path that names it."""
    from transformers import PretrainedConfig
    seen: set[int] = set()

    def configs(path: str, config) -> Iterator[tuple[str, object]]:
        if not isinstance(config, PretrainedConfig) or id(config) in seen:
            return
        seen.add(id(config))
        yield path, config
        for key in getattr(config, "sub_configs", {}) or {}:
            yield from configs(f"{path}.{key}", getattr(config, key, None))

    for path, module in root.named_modules(remove_duplicate=False):
        if id(module) not in seen:
            seen.add(id(module))
            yield path, module
        yield from configs(f"{path}.config" if path else "config", module.__dict__.get("config"))


@contextlib.contextmanager
def recording(root: torch.nn.Module) -> Iterator[set[Read]]:
    """While active, the plain values read from ``root``'s modules and configs are collected in the
    yielded set (see the module doc)."""
    reads: set[Read] = set()
    subclasses: dict[type, type] = {}
    swapped = []
    try:
        for _, obj in objects(root):
            cls = type(obj)
            if cls not in subclasses:
                subclasses[cls] = _recording_class(cls, reads)
            obj.__class__ = subclasses[cls]
            swapped.append((obj, cls))
        yield reads
    finally:
        for obj, cls in swapped:
            obj.__class__ = cls


def _recording_class(cls: type, reads: set[Read]) -> type:
    name = class_name(cls)
    # a module's private attributes are torch's bookkeeping (its parameter, buffer and hook dicts);
    # a config's are its fields (``_attn_implementation``)
    private = "_" if issubclass(cls, torch.nn.Module) else "__"

    def __getattribute__(self, attribute):
        value = cls.__getattribute__(self, attribute)
        if not attribute.startswith(private) and _plain(value):
            reads.add((name, attribute))
        return value

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def current(model: torch.nn.Module, reads) -> tuple:
    """The values of ``reads`` on every object of ``model`` now, as ``(path, attribute, repr)``."""
    by_class: dict[str, list[str]] = {}
    for owner, attribute in sorted(reads):
        by_class.setdefault(owner, []).append(attribute)
    found = []
    for path, obj in objects(model):
        for attribute in by_class.get(class_name(type(obj)), ()):
            found.append((path, attribute, repr(getattr(obj, attribute, "<unset>"))))
    return tuple(found)
