"""Weights by name from safetensors files: only the tensors asked for, checked against what they must be.

Used where a program runs with weights that are not a loaded model's: a saved program
(``qgraph.load``) and a model instrumented on the ``meta`` device (``ig.load_weights``), which reads
only the parameters of its own stage. A folder is read as a checkpoint (every ``*.safetensors`` in
it, each opened with ``safe_open``, so nothing else is read into memory). Tied tensors (the
embedding and the lm_head) are one tensor kept under any one of their names. ``check_fit`` refuses,
as a strict ``load_state_dict`` does, weights that lack a tensor (or hold one of another shape or
dtype) and, given the names ``unexpected`` finds, weights that hold tensors of another model.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import MissingFile, WeightsMismatch


def files(location) -> list[Path]:
    """The safetensors files at ``location``: the file itself, or every ``*.safetensors`` in a folder."""
    location = Path(location)
    found = sorted(location.glob("*.safetensors")) if location.is_dir() else [location]
    if not found or not all(file.is_file() for file in found):
        raise MissingFile(f"no safetensors weights at {location} (give a .safetensors file or a checkpoint "
                          f"folder holding them)")
    return found


@contextmanager
def _opened(file: Path, device=None):
    """``safe_open(file)``; a file that is not safetensors (or is cut short) is a ``WeightsMismatch`` naming it."""
    try:
        with safe_open(file, framework="pt", device=str(device or "cpu")) as handle:
            yield handle
    except SafetensorError as error:
        raise WeightsMismatch(f"{file} is not a readable safetensors file ({error}): give a .safetensors file or "
                              f"a checkpoint folder holding them") from None


def names(location) -> list[str]:
    """Every tensor name in the safetensors file or folder at ``location`` (read from the headers only)."""
    found = []
    for file in files(location):
        with _opened(file) as handle:
            found += handle.keys()
    return found


def read(location, wanted, tied=(), device=None) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` for the ``wanted`` names from a safetensors file or a folder of them;
    each group in ``tied`` shares one tensor (found under any of its names)."""
    wanted = set(wanted)
    aliases = {name: group for group in tied for name in group}
    looked_for = wanted | {alias for name in wanted for alias in aliases.get(name, ())}
    found = {}
    for file in files(location):
        with _opened(file, device) as handle:
            for key in handle.keys():
                if key in looked_for:
                    found[key] = handle.get_tensor(key)
    for name in wanted:
        if name not in found:
            present = next((found[alias] for alias in aliases.get(name, ()) if alias in found), None)
            if present is not None:
                found[name] = present
    return {name: found[name] for name in wanted if name in found}


def unexpected(given, known, ignored=()) -> list[str]:
    """The ``given`` names that are not ``known`` and match no ``ignored`` pattern (searched as Hugging
    Face searches a model class's ``_keys_to_ignore_on_load_unexpected``)."""
    known = set(known)
    return [name for name in given if name not in known and not any(re.search(p, name) for p in ignored)]


def few(names: list[str], shown: int = 3) -> str:
    """A few of ``names`` and how many there are: ``a, b, c and 5 more (8 tensors)``."""
    head = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
    return f"{head} ({len(names)} tensor{'s' if len(names) != 1 else ''})"


def check_fit(what: str, expected: dict[str, tuple], tensors: dict[str, torch.Tensor], source: str,
              extra: list[str] = (), owner: str = "", hint: str = "") -> None:
    """Every ``expected`` name (``(shape, dtype)``) is in ``tensors`` with that shape and dtype, and
    there are no ``extra`` names (tensors ``owner`` never had); ``WeightsMismatch`` naming a few of
    the missing and extra ones (and how many), or the first of another shape or dtype, then ``hint``
    (the way out)."""
    missing = [name for name in expected if name not in tensors]
    problems = [f"{source} has no {few(missing)}"] if missing else []
    if extra:
        problems.append(f"{source} holds {few(list(extra))} that {owner} never had")
    if problems:
        raise WeightsMismatch(f"the weights do not fit {what}: {'; '.join(problems)}{hint}")
    for name, (shape, dtype) in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(shape) or _dtype(tensor.dtype) != _dtype(dtype):
            raise WeightsMismatch(f"the weights do not fit {what}: {name} is {tuple(shape)} {_dtype(dtype)} there, "
                                  f"{tuple(tensor.shape)} {_dtype(tensor.dtype)} in {source}{hint}")


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_names(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s tensors as its ``state_dict`` (and a checkpoint of it) has them:
    parameters under every name a tied one has, and persistent buffers."""
    return list(model.state_dict(keep_vars=True))


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """The parameter names of ``model`` that share one parameter (tied embeddings)."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return [group for group in groups.values() if len(group) > 1]
