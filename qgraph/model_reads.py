"""The model's parameters and buffers a program takes, read at each call as ``getattr`` reads them, in one batch.

A program reads the model's own tensors at every call (``Program.arguments``): hundreds of them (325 on
the 0.8B shape), each ``getattr(module, name)``. A parameter is not in its module's ``__dict__``, so each
read falls through to ``Module.__getattr__``, a Python frame: about 0.8 µs a read, a third of a
millisecond a call on the 0.8B shape.

``ModelReads.read()`` reads ``module._parameters[name]`` (a buffer: ``module._buffers[name]``) with
C-level maps, where that is what ``getattr`` returns. ``getattr`` looks in the class first, then the
instance's ``__dict__``, and only then calls ``__getattr__``, which ``Module`` answers from
``_parameters``, then ``_buffers``. So the batch is read where, at this call: each module's class is
the one seen when the reads were made, a class with torch's ``__getattribute__`` and ``__getattr__``
and no attribute of that name; no instance ``__dict__`` holds the name; a parameter is in
``_parameters``, a buffer in ``_buffers`` and not in ``_parameters``. Where any of that fails, every
tensor is read by ``getattr`` itself. Memory: lists of the modules and names (no tensor is kept).
"""
from __future__ import annotations

from itertools import repeat
from operator import attrgetter, contains, is_

import torch

_PARAMETERS = attrgetter("_parameters")
_BUFFERS = attrgetter("_buffers")
_DICT = attrgetter("__dict__")
_MISSING = object()


def _plain(pair: tuple[type, str]) -> bool:
    """Whether an instance of ``cls`` answers ``getattr(instance, name)`` from ``Module.__getattr__``
    (when its ``__dict__`` lacks the name)."""
    cls, name = pair
    return (cls.__getattribute__ is object.__getattribute__
            and getattr(cls, "__getattr__", None) is torch.nn.Module.__getattr__ and not hasattr(cls, name))


class ModelReads:
    """``getattr(module, name)`` of each ``(module, name, is_parameter)`` in ``tensors`` (the parameters
    first, then the buffers), read in one batch (see the module's doc)."""

    def __init__(self, tensors: list[tuple[torch.nn.Module, str, bool]]):
        self.modules = [module for module, _, _ in tensors]
        self.names = [name for _, name, _ in tensors]
        split = sum(parameter for _, _, parameter in tensors)
        self.parameters = (self.modules[:split], self.names[:split])
        self.buffers = (self.modules[split:], self.names[split:])
        self.classes = list(map(type, self.modules))
        self.pairs = list(dict.fromkeys(zip(self.classes, self.names)))

    def __len__(self) -> int:
        return len(self.modules)

    def read(self) -> list:
        """The tensors (or None where a module holds None under the name), as ``getattr`` reads them."""
        try:
            found = self._batch()
        except (AttributeError, TypeError):  # a module whose bookkeeping is not torch's: getattr decides
            found = None
        return list(map(getattr, self.modules, self.names)) if found is None else found

    def _batch(self) -> list | None:
        modules, names = self.modules, self.names
        if (list(map(type, modules)) != self.classes or not all(map(_plain, self.pairs))
                or True in list(map(contains, map(_DICT, modules), names))):
            return None
        (parameter_modules, parameter_names), (buffer_modules, buffer_names) = self.parameters, self.buffers
        parameters = list(map(dict.get, map(_PARAMETERS, parameter_modules), parameter_names, repeat(_MISSING)))
        buffers = list(map(dict.get, map(_BUFFERS, buffer_modules), buffer_names, repeat(_MISSING)))
        if (True in list(map(is_, parameters, repeat(_MISSING))) or True in list(map(is_, buffers, repeat(_MISSING)))
                or True in list(map(contains, map(_PARAMETERS, buffer_modules), buffer_names))):
            return None
        return parameters + buffers
