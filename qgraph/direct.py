"""A program's eager forward with each operator called at its C++ entry point: what an eager call runs.

A ``GraphModule``'s generated ``forward`` calls every node as ``torch.ops.aten.mul.Tensor(...)``: four
attribute reads and ``OpOverload.__call__``, a Python frame whose whole body is ``self._op(*args,
**kwargs)``. That is about a microsecond per node, more than the plain Hugging Face forward pays for
the same op (it calls ``torch.mul``), and export adds ``aten._assert_tensor_metadata`` before each
``.to()`` (a dtype, device and layout check through the dispatcher, several microseconds each). On the
tiny model the two cost about as much as the rest of a call's fixed cost.

``forward(module)`` is the module's own generated ``forward`` (its code object: nothing is compiled
again) with another ``torch`` in its globals, in which ``torch.ops.<namespace>.<op>.<overload>`` is
what calling that overload calls (``compat.op_entry``), with the same arguments: the same dispatch,
the same kernels, the same values. ``_assert_tensor_metadata`` first compares the tensor's dtype,
device and layout in Python; only where one differs (or sizes or strides are asked) does the op itself
run and decide, so it raises exactly where it did. Every other name is torch's. The graph, its code and
``module(...)`` stay as they were (``torch.compile``, the stages and saving read those); the forward is
kept per module and made again after a ``recompile``. It is called directly, not through
``Module.__call__``: a program's GraphModule has no hooks, and an error raised inside keeps its whole
traceback (``GraphModule.__call__`` prints the generated line and drops the traceback). Memory: one
function object per program.
"""
from __future__ import annotations

import types
import weakref
from collections.abc import Callable

import torch

from .compat import op_entry

_METADATA = torch.ops.aten._assert_tensor_metadata.default
_OVERLOAD = type(_METADATA)
_WALKED = (type(torch.ops), type(torch.ops.aten), type(torch.ops.aten.add))  # torch.ops, a namespace, a packet


def _assert_tensor_metadata(a, size=None, stride=None, dtype=None, *, device=None, layout=None):
    """``aten._assert_tensor_metadata``, passed in Python where the tensor's dtype, device and layout
    equal those asked (then the op passes too); anything else runs the op."""
    if (size is None and stride is None and (dtype is None or a.dtype == dtype)
            and (device is None or a.device == device) and (layout is None or a.layout == layout)):
        return None
    return _METADATA(a, size, stride, dtype, device=device, layout=layout)


def _direct(value):
    """What the forward reads ``value`` as: an overload as ``op_entry``, ``torch.ops``' namespaces and
    packets walked the same way, anything else as it is."""
    if value is _METADATA:
        return _assert_tensor_metadata
    if isinstance(value, _OVERLOAD):
        return op_entry(value)
    return _Ops(value) if type(value) in _WALKED else value


class _Ops:
    """``torch.ops``, one of its namespaces or a packet: each attribute read once through ``_direct``,
    then kept as a plain attribute."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name: str):
        value = _direct(getattr(self._real, name))
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):  # a packet called without an overload: its own call
        return self._real(*args, **kwargs)


class _Torch(types.ModuleType):
    """``torch`` with ``ops`` read through ``_Ops``; any other name is torch's, kept after its first read."""

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        setattr(self, name, value)
        return value


_TORCH = _Torch("torch")
_TORCH.ops = _Ops(torch.ops)  # type: ignore[attr-defined]
# module -> (the forward its class has, ours made from it); the module is not held
_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forward(module: torch.fx.GraphModule) -> Callable:
    """``module``'s forward, bound to it, with each operator called at its entry point (see above)."""
    generated = type(module).forward
    kept = _FORWARDS.get(module)
    if kept is None or kept[0] is not generated:
        kept = _FORWARDS[module] = (generated, types.FunctionType(
            generated.__code__, {**generated.__globals__, "torch": _TORCH}, generated.__name__,
            generated.__defaults__, generated.__closure__))
    return types.MethodType(kept[1], module)
