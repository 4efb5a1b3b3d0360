"""Weights by name from safetensors files: only the tensors asked for, checked against what they must be.

Used where a program runs with weights that are not a loaded model's: a saved program
(``qgraph.load``) and a model instrumented on the ``meta`` device (``ig.load_weights``), which reads
only the parameters of its own stage. A folder is read as a checkpoint (every ``*.safetensors`` in
it, each opened with ``safe_open``, so nothing else is read into memory). Tied tensors (the
embedding and the lm_head) are one tensor kept under any one of their names.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


class WeightsMismatch(ValueError):
    """Weights that do not fit what they are loaded for; the message names the tensor."""


def read(location, wanted, tied=(), device=None) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` for the ``wanted`` names from a safetensors file or a folder of them;
    each group in ``tied`` shares one tensor (found under any of its names)."""
    location = Path(location)
    files = sorted(location.glob("*.safetensors")) if location.is_dir() else [location]
    if not files or not all(file.is_file() for file in files):
        raise FileNotFoundError(f"no safetensors weights at {location} (give a .safetensors file or a checkpoint "
                                f"folder holding them)")
    wanted = set(wanted)
    aliases = {name: group for group in tied for name in group}
    looked_for = wanted | {alias for name in wanted for alias in aliases.get(name, ())}
    found = {}
    for file in files:
        with safe_open(file, framework="pt", device=str(device or "cpu")) as handle:
            for key in handle.keys():
                if key in looked_for:
                    found[key] = handle.get_tensor(key)
    for name in wanted:
        if name not in found:
            present = next((found[alias] for alias in aliases.get(name, ()) if alias in found), None)
            if present is not None:
                found[name] = present
    return {name: found[name] for name in wanted if name in found}


def check_fit(what: str, expected: dict[str, tuple], tensors: dict[str, torch.Tensor], source: str) -> None:
    """Every ``expected`` name (``(shape, dtype)``) is in ``tensors`` with that shape and dtype;
    ``WeightsMismatch`` naming the first that is not."""
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise WeightsMismatch(f"the weights do not fit {what}: {source} has no {', '.join(missing[:3])}"
                              f"{f' (and {len(missing) - 3} more)' if len(missing) > 3 else ''}")
    for name, (shape, dtype) in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(shape) or _dtype(tensor.dtype) != _dtype(dtype):
            raise WeightsMismatch(f"the weights do not fit {what}: {name} is {tuple(shape)} {_dtype(dtype)} there, "
                                  f"{tuple(tensor.shape)} {_dtype(tensor.dtype)} in {source}")


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """The parameter names of ``model`` that share one parameter (tied embeddings)."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return [group for group in groups.values() if len(group) > 1]
