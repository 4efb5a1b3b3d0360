"""The options a value takes in ``values={name: {option: ...}}``, checked against what each takes."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..edit_checks import indices
from ..errors import InvalidArgument, InvalidType

# The options a value takes (every value takes ``grad``)
OPTIONS = {"states": ("dtype", "heads"), "state": ("positions", "dtype", "heads")}


def check_options(values, resolve, catalogue, names) -> dict[str, dict]:
    """Per-value options from ``values={name: {option: ...}}``, checked against what each value takes."""
    given = {}
    if isinstance(values, Mapping):
        for pattern, option in values.items():
            if option is not None and not isinstance(option, Mapping):
                raise InvalidType(f"values={{'{pattern}': {option!r}}}: a value's options are a dict, e.g. "
                                  f"{{'grad': True}} or {{'positions': [0, -1]}} (or {{}} for none)")
            given.update(dict.fromkeys(resolve(pattern), dict(option or {})))
    options = {}
    for name in names:
        kind = catalogue[name].spec.name if catalogue[name].spec else ""
        option, allowed = given.get(name, {}), OPTIONS.get(kind, ()) + ("grad",)
        if option.get("grad") and catalogue[name].derived:
            raise InvalidArgument(f"'{name}' is computed after the run from other values, so it has no gradient "
                                  f"of its own: ask 'grad' of the values it comes from")
        unknown = set(option) - set(allowed)
        if unknown:
            raise InvalidArgument(f"'{name}' takes no option {sorted(unknown)}"
                                  + (f"; it takes {list(allowed)}" if allowed else ""))
        if kind == "state" and "positions" not in option:
            raise InvalidArgument(f"'{name}' needs positions: ask values={{'{name}': {{'positions': [...]}}}}, the "
                                  f"tokens after which to read the state (or ask for 'states', every token)")
        option = dict(option)
        for selector in ("positions", "heads"):
            if selector in option:
                option[selector] = indices(option[selector], selector, f"'{name}' option {selector}")
        if "heads" in option:
            entry = catalogue[name]
            heads = entry.shape[entry.spec.dims.index("value_heads")]
            bad = [head for head in option["heads"] if not -heads <= head < heads]
            if bad:
                raise InvalidArgument(f"'{name}' option heads: {bad} out of range; it has {heads} heads (0 to "
                                      f"{heads - 1}, or negative from the end)")
            option["heads"] = [head % heads for head in option["heads"]]
        dtype = option.get("dtype", torch.float32)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InvalidType(f"'{name}' option dtype: {dtype!r} is not a floating torch dtype; give one such as "
                              f"torch.float32 or torch.bfloat16")
        if option:
            options[name] = option
    return options
