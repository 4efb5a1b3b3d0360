"""Edits as data: ``Replace``, ``Add``, ``Scale`` and ``Zero`` with their regions travel as a JSON object
and the tensors it names (a ``Read`` as ``{"read": name}``, resolved by the server as a value name);
a function edit travels as the graph ``serve.function`` exports on the client.

``encode`` (the client) turns an edit into ``(spec, tensors)``; ``decode`` (the server) turns an untrusted
spec back into an edit, every field checked against a positive list, or raises ``EditError`` (422).
"""
from __future__ import annotations

import numbers

import torch

from ..edits import AXES, Add, Edit, Read, Region, Replace, Scale, Zero
from ..errors import EditError
from ..saved.fields import integer, list_of, number, text
from .function import export_function, load_function

KINDS = {"Replace": Replace, "Add": Add, "Scale": Scale, "Zero": Zero}
_NUMBERS = {"Add": ("scale",), "Scale": ("factor",)}  # a number field, or (Scale) a tensor by name
_TENSORS = {"Replace": "tensor", "Add": "tensor"}
_MAX_INDICES = 4096  # indices of one region selector
_INDICES = list_of(integer(-2**31 + 1, 2**31 - 1), 1, _MAX_INDICES)
_NUMBER = number()  # finite
_NAME = text(200, printable=True)  # a value a Read names (the server resolves it as it resolves every name)
_FLAGS = {"Add": ("relative",)}  # a true/false field


def encode(name: str, edit, prefix: str, layout=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(spec, tensors)`` for the edit at ``name``; its tensors are named ``{prefix}.*``. A function
    edit is exported here, on the client, over ``layout`` (the value's ``{"dims", "shape", "dtype"}``
    from the server's catalogue): one that cannot be exported is refused here, with the reason."""
    if isinstance(edit, Edit):
        raise EditError(f"the edit at '{name}' is an Edit (a function of the region, its reads and the mask), which "
                        f"cannot travel to a server; read values with Replace/Add/Scale(qgraph.Read(...)), steer with "
                        f"Add(..., relative=True), or give a function of the value alone")
    if isinstance(edit, Region):
        kind = type(edit).__name__
        if kind not in KINDS:
            raise EditError(f"the edit at '{name}' is a {kind}; a remote call takes Replace, Add, Scale, Zero or a "
                            f"function edit")
        spec: dict[str, object] = {"kind": kind}
        tensors: dict[str, torch.Tensor] = {}
        for selector in AXES:
            if getattr(edit, selector) is not None:
                spec[selector] = list(getattr(edit, selector))
        field = _TENSORS.get(kind)
        if field is not None:
            spec[field] = _data(getattr(edit, field), f"{prefix}.{field}", tensors)
        for option in _NUMBERS.get(kind, ()):
            value = getattr(edit, option)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                spec[option] = float(value)
            else:
                spec[option] = _data(value, f"{prefix}.{option}", tensors)
        for flag in _FLAGS.get(kind, ()):
            if getattr(edit, flag):
                spec[flag] = True
        return spec, tensors
    if callable(edit):
        if layout is None:
            raise EditError(f"the function edit at '{name}': the server's catalogue gives no layout for it")
        dims, shape, dtype = layout["dims"], layout["shape"], getattr(torch, layout["dtype"])
        example = torch.zeros([2 if d == "batch" else 3 if isinstance(s, str) else s for d, s in zip(dims, shape)],
                              dtype=dtype)
        data, held = export_function(edit, example, tuple(dims), name)
        return {"kind": "function", "graph": data}, {f"{prefix}.{key}": tensor for key, tensor in held.items()}
    raise EditError(f"the edit at '{name}' is {edit!r}: give Replace, Add, Scale, Zero or a function tensor -> tensor")


def _data(value, key: str, tensors: dict) -> object:
    """A tensor field's spec: ``{"read": name}`` for a ``Read``, else the key its tensor travels by."""
    if isinstance(value, Read):
        return {"read": value.name}
    tensors[key] = _as_tensor(value)
    return key


def _as_tensor(value) -> torch.Tensor:
    """A tensor field's data as it travels: a number or list as float32, True/False (a mask's) as bool."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(value, dtype=torch.bool if _bools(value) else torch.float32)


def _bools(value) -> bool:
    """Whether ``value`` is True/False or a (nested) list of them."""
    return isinstance(value, bool) or (isinstance(value, (list, tuple)) and bool(value) and all(map(_bools, value)))


def decode(name: str, spec, tensors: dict[str, torch.Tensor], prefix: str, used: set):
    """The edit of an untrusted ``spec`` for the value ``name``; ``tensors`` are the request's, of which
    those named ``{prefix}.*`` are this edit's (their names go into ``used``)."""
    where = f"the edit at '{name}'"
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        raise EditError(f"{where} is not an object with a kind (one of {', '.join(KINDS)}, function)")
    kind = spec["kind"]
    if kind == "function":
        if set(spec) != {"kind", "graph"}:
            raise EditError(f"{where}: a function edit holds kind and graph only, not {sorted(set(spec) - {'kind'})}")
        held = {key[len(prefix) + 1:]: tensor for key, tensor in tensors.items() if key.startswith(prefix + ".")}
        used.update(f"{prefix}.{key}" for key in held)
        return load_function(spec["graph"], held, name)
    if kind not in KINDS:
        raise EditError(f"{where} is of kind {kind[:40]!r}; the kinds are {', '.join(KINDS)} and function")
    allowed = {"kind", *AXES, *([_TENSORS[kind]] if kind in _TENSORS else []), *_NUMBERS.get(kind, ()),
               *_FLAGS.get(kind, ())}
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise EditError(f"{where}: a {kind} takes {', '.join(sorted(allowed - {'kind'}))}, not {unknown}")
    fields = {}
    for selector in AXES:
        if selector in spec:
            chosen = spec[selector]
            if not _INDICES(chosen):
                raise EditError(f"{where}: {selector} takes a list of 1 to {_MAX_INDICES} ints, not {str(chosen)[:60]}")
            fields[selector] = chosen
    if kind in _TENSORS:
        fields[_TENSORS[kind]] = _tensor(spec.get(_TENSORS[kind]), tensors, prefix, used, where)
    for flag in _FLAGS.get(kind, ()):
        if flag in spec:
            if not isinstance(spec[flag], bool):
                raise EditError(f"{where}: {flag} takes true or false, not {str(spec[flag])[:40]}")
            fields[flag] = spec[flag]
    for option in _NUMBERS.get(kind, ()):
        value = spec.get(option, 1.0 if kind == "Add" else None)
        if isinstance(value, (str, dict)):
            value = _tensor(value, tensors, prefix, used, where)
        elif not _NUMBER(value):
            raise EditError(f"{where}: {option} takes a finite number or a tensor's name, not {str(value)[:40]}")
        fields[option] = value
    return KINDS[kind](**fields)


def _tensor(key, tensors: dict, prefix: str, used: set, where: str) -> torch.Tensor | Read:
    if isinstance(key, dict):  # a Read: one value's name, resolved (and refused if unknown) as every name is
        if set(key) != {"read"} or not _NAME(key["read"]):
            raise EditError(f"{where}: a read is {{\"read\": a value's name}}, not {str(key)[:60]}")
        return Read(key["read"])
    if not isinstance(key, str) or not key.startswith(prefix + ".") or key not in tensors:
        raise EditError(f"{where} names the tensor {str(key)[:60]!r}, which the body does not hold as {prefix}.*")
    tensor = tensors[key]
    if not tensor.is_floating_point() and tensor.dtype != torch.bool:  # bool: a mask's (the value's dtype is checked)
        raise EditError(f"{where}: its tensor {key} is {tensor.dtype}; an edit's tensor is floating (or bool, a "
                        f"mask's)")
    used.add(key)
    return tensor
