"""A model's fingerprint, and a cheap check, exact, that it still holds: what every call runs first.

``fingerprint(model, reads)`` (``qgraph.export.fingerprint``) walks the model: every module's path and
class, every parameter's and buffer's name, shape, dtype and device (and which are one tensor), every
module object, the attention and experts implementations, and the plain values the export read
(``constants.current``). Built as tuples of strings, it costs more than the rest of a call's fixed cost
(0.6 ms on the tiny model, 3 ms on the 0.8B shape), so a call does not rebuild it. ``unchanged()``
re-reads, with C-level maps over lists kept from the last walk, everything the fingerprint is computed
from:

- each module object the walk met (held here, so an id cannot be reused), its class (and the class's
  name), and the keys, in order, and the objects (by id) of its ``_modules``, ``_parameters`` and
  ``_buffers``: the tree the walk would follow, so its paths, module ids and tied parameters;
- each parameter's and buffer's shape, dtype and device (``param.data = ...`` changes them in place);
- the config each module holds (by id), each config's class and sub-configs (by id);
- the attention and experts implementations (``fingerprint.implementations``);
- ``repr`` of every plain value the export read, on every object that has it, as ``constants.current``
  (where the value read is the very object read before, only one that can change in place, a list or a
  dict, is repr'd again: a number's or a string's repr cannot change).

If all of these are as they were, the fingerprint is the same one, so ``unchanged()`` never passes a
model whose fingerprint changed. When it does not pass, ``holds()`` computes the fingerprint itself, as
every call did before: a change it does not see (a parameter replaced by one like it) keeps the
programs, and the lists are taken again (a model changed at every call pays both). A module class that
walks its children its own way (overriding ``named_modules``, ``named_parameters``, ...) makes no such
lists: then every check is the whole fingerprint. Memory: lists of the model's module, parameter, buffer
and config objects and of the plain values read, and one small tuple per tensor (no tensor data); a
module replaced in the model stays held until the next call takes the lists again.
"""
from __future__ import annotations

from itertools import chain, repeat
from operator import attrgetter, is_, methodcaller
from typing import TYPE_CHECKING

import torch

from . import constants
from .fingerprint import fingerprint, implementations

if TYPE_CHECKING:  # a type only: transformers is imported with the model
    from transformers import PreTrainedModel

_DICTS = attrgetter("_modules", "_parameters", "_buffers")
_META = attrgetter("shape", "dtype", "device")
_DICT = attrgetter("__dict__")
_CONFIG = methodcaller("get", "config")
# the walks the fingerprint makes (named_parameters walks named_modules through _named_members); a class
# that overrides one may follow other state than its _modules, _parameters and _buffers
_WALKS = ("named_modules", "modules", "named_parameters", "named_buffers", "_named_members")
_UNSET = "<unset>"  # what constants.current reads where an object lacks the attribute
_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


class ModelWatch:
    """``model``'s fingerprint over ``reads`` (``fingerprint``), and whether it still holds."""

    def __init__(self, model: PreTrainedModel, reads=()):
        self.model, self.reads = model, frozenset(reads)
        lists = _lists(model, self.reads)  # first: a change between the two fails the next check
        self.fingerprint = fingerprint(model, self.reads)
        self._lists = lists

    def unchanged(self) -> bool:
        """Whether everything the fingerprint is computed from is as it was (then the fingerprint is too);
        False on any difference, even one the fingerprint ignores."""
        kept = self._lists
        if kept is None:
            return False
        try:
            return _now(self.model, kept) == kept.values and _reads_unchanged(kept)
        except Exception:  # anything unexpected (a dict replaced by another kind of object): the full check decides
            return False

    def holds(self) -> bool:
        """Whether the model's fingerprint is still the one taken: by ``unchanged``, else by computing it
        (then taking the lists again, if it holds)."""
        if self.unchanged():
            return True
        lists = _lists(self.model, self.reads)
        if fingerprint(self.model, self.reads) != self.fingerprint:
            return False
        self._lists = lists
        return True


class _Lists:
    """What ``_now`` reads (the model's objects) and what it read (``values``); the plain values the export
    read (``owners``' ``attributes``): the objects read, their reprs, and which can change in place."""

    def __init__(self, modules: list, classes: list, tensors: list, configs: list, owners: list, attributes: list):
        self.modules, self.classes, self.tensors, self.configs = modules, classes, tensors, configs
        self.owners, self.attributes = owners, attributes
        self.values: tuple = ()
        self.read = list(map(getattr, owners, attributes, repeat(_UNSET)))
        self.reprs = list(map(repr, self.read))
        self.mutable = [i for i, value in enumerate(self.read) if not _frozen(value)]
        self.mutable_reprs = [self.reprs[i] for i in self.mutable]


def _lists(model: PreTrainedModel, reads: frozenset) -> _Lists | None:
    """The objects of ``model`` the fingerprint reads, and what they hold now; None if a class walks its own way."""
    modules = list(model.modules())
    walkers = set(map(type, modules))
    if any(getattr(cls, walk) is not getattr(torch.nn.Module, walk) for cls in walkers for walk in _WALKS):
        return None
    dicts = list(chain.from_iterable(map(_DICTS, modules)))
    tensors = list({id(v): v for v in chain.from_iterable(map(dict.values, dicts[1::3] + dicts[2::3]))
                    if v is not None}.values())
    by_class: dict[str, list[str]] = {}
    for owner, attribute in sorted(reads):
        by_class.setdefault(owner, []).append(attribute)
    objects = [obj for _, obj in constants.objects(model)]
    configs = [obj for obj in objects if not isinstance(obj, torch.nn.Module)]
    classes = list(dict.fromkeys(map(type, objects)))  # the reads are matched to objects by their class's name
    pairs = [(obj, attribute) for obj in objects for attribute in by_class.get(constants.class_name(type(obj)), ())]
    lists = _Lists(modules, classes, tensors, configs, [obj for obj, _ in pairs], [attribute for _, attribute in pairs])
    lists.values = _now(model, lists)
    return lists


def _reads_unchanged(lists: _Lists) -> bool:
    """Whether ``repr`` of each plain value the export read is as it was (``constants.current``): where each
    is the very object read before, only those that can change in place (lists, dicts) are repr'd again."""
    values = list(map(getattr, lists.owners, lists.attributes, repeat(_UNSET)))
    if all(map(is_, values, lists.read)):
        return list(map(repr, map(values.__getitem__, lists.mutable))) == lists.mutable_reprs
    return list(map(repr, values)) == lists.reprs


def _frozen(value) -> bool:
    """Whether ``value``'s repr cannot change while it is the same object (no list or dict in it)."""
    return type(value) in _SCALARS or (type(value) is tuple and all(map(_frozen, value)))


def _now(model: PreTrainedModel, lists: _Lists) -> tuple:
    """What the fingerprint is computed from, read now from the objects in ``lists`` (but the plain values
    the export read: ``_reads_unchanged``)."""
    modules = lists.modules
    dicts = list(chain.from_iterable(map(_DICTS, modules)))
    return (
        list(map(type, modules)), list(map(constants.class_name, lists.classes)),
        list(chain.from_iterable(dicts)), list(map(id, chain.from_iterable(map(dict.values, dicts)))),
        list(map(_META, lists.tensors)),
        list(map(id, map(_CONFIG, map(_DICT, modules)))), [_sub_configs(config) for config in lists.configs],
        implementations(model),
    )


def _sub_configs(config) -> tuple:
    """A config's class and the sub-configs ``constants.objects`` walks into from it (by id)."""
    keys = tuple(getattr(config, "sub_configs", {}) or {})
    return type(config), keys, tuple(id(getattr(config, key, None)) for key in keys)
