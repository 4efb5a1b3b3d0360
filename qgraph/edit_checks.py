"""What the edits check of what they are given: region selectors (``indices``), the data of a tensor edit
and the tensors an edit brings to the value it edits; each error names where and what to give instead."""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from .errors import EditError, InvalidArgument, InvalidType


def indices(chosen, what: str, where: str) -> list[int]:
    """``chosen`` (an int, or a non-empty list, tuple or 1-D integer tensor of ints) as a list of
    ints; a ``TypeError`` or ``ValueError`` naming ``where`` and what ``what`` takes otherwise."""
    takes = (f"{what} takes an int or a non-empty list of ints (negative ones count from the end), "
             f"e.g. {what}=[0, -1]")
    if isinstance(chosen, torch.Tensor):
        if chosen.dim() > 1 or chosen.is_floating_point() or chosen.is_complex() or chosen.dtype == torch.bool:
            raise InvalidType(f"{where}: got a {chosen.dtype} tensor of shape {tuple(chosen.shape)}; {takes}")
        chosen = chosen.tolist()
    if type(chosen).__module__ == "numpy":  # an array or a numpy int
        chosen = chosen.tolist()
    if isinstance(chosen, slice):
        raise InvalidType(f"{where}: got {chosen!r}; {takes} (for a range write list(range(start, stop)))")
    if is_int(chosen):
        return [int(chosen)]
    if isinstance(chosen, (str, bytes)) or not isinstance(chosen, Sequence):
        raise InvalidType(f"{where}: got {type(chosen).__name__} {chosen!r}; {takes}")
    bad = [item for item in chosen if not is_int(item)]
    if bad:
        raise InvalidType(f"{where}: {bad!r} are not ints; {takes}")
    if not chosen:
        raise InvalidArgument(f"{where}: the list is empty, so it selects nothing; {takes} (leave {what} out to "
                              f"select all)")
    return [int(item) for item in chosen]


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_data(data, where: str) -> None:
    """A tensor, a number or a nested list of numbers; a TypeError naming ``where`` otherwise."""
    if isinstance(data, torch.Tensor):
        return
    try:
        torch.as_tensor(data, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise InvalidType(f"{where}: got {type(data).__name__} {str(data)[:60]!r}; it takes a tensor (or a number, "
                          f"or a nested list of numbers) broadcastable to the value or the region selected") from None


def check_tensor(tensor: torch.Tensor, value: torch.Tensor, where: str, what: str = "the tensor") -> None:
    """``tensor`` must live on ``value``'s device, be floating when ``value`` is and bool when it is (a mask,
    which a number or a float tensor would set by a silent cast)."""
    if tensor.device != value.device:
        raise EditError(f"{where}: {what} is on {tensor.device} but the value is on {value.device}: move it there "
                        f"(.to('{value.device}'))")
    if value.is_floating_point() and not tensor.is_floating_point():
        raise EditError(f"{where}: {what} is {tensor.dtype} but the value is {value.dtype}: give a floating tensor "
                        f"(.to({value.dtype}))")
    if value.dtype == torch.bool and tensor.dtype != torch.bool:
        raise EditError(f"{where}: {what} is {tensor.dtype} but the value is a bool mask: give True or False, or a "
                        f"bool tensor (a comparison, or .bool() of it)")
