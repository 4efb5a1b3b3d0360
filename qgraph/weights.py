"""Weights by name from safetensors files: only the tensors asked for, from only the files that hold them.

Used where a program runs with weights that are not a loaded model's: a saved program
(``qgraph.load``) and a model instrumented on the ``meta`` device (``ig.load_weights``), which reads
only the parameters of its own stage. Weights are a ``.safetensors`` file, an index
(``<name>.safetensors.index.json``: ``{"metadata": {"total_size": bytes}, "weight_map": {tensor
name: shard file}}``, as a Hugging Face checkpoint has, its shards beside it) or a folder: the index
in it if it holds one (as ``from_pretrained`` reads it), else every ``*.safetensors`` in it. Where
each tensor is comes from the index, or from each file's header (its first bytes, nothing else);
``read`` then opens (``safe_open``) only the files that hold a tensor asked for (``shards`` names
them), so a stage's process never opens a shard that holds only other stages' tensors (which
need not even be on its machine).
``write`` writes tensors so: one file, or shards of at most ``max_shard_size`` and their index.
Tied tensors (the embedding and the lm_head) are one tensor kept under any one of their names.
``check_fit`` refuses, as a strict ``load_state_dict`` does, weights that lack a tensor (or hold one
of another shape or dtype) and, given the names ``unexpected`` finds, weights that hold tensors of
another model.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open

from .errors import InvalidArgument, MissingFile, WeightsMismatch

SHARD_SIZE = "5GB"  # the largest shard ``write`` (and ``ig.save``) writes unless told
INDEX = ".safetensors.index.json"  # <name>.safetensors.index.json indexes <name>-0000i-of-0000N.safetensors
_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_WAY_OUT = "give a .safetensors file, a safetensors index or a checkpoint folder holding them"


def size_in_bytes(size) -> int:
    """``max_shard_size`` in bytes: a number of bytes, or a size such as ``"5GB"`` (10**9 bytes a GB, as
    Hugging Face counts) or ``"500MiB"`` (2**20 bytes a MiB)."""
    pattern = r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)\s*"
    found = re.fullmatch(pattern, size, re.IGNORECASE) if isinstance(size, str) else None
    count = int(float(found.group(1)) * _UNITS[found.group(2).lower()]) if found else size
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise InvalidArgument(f"max_shard_size= takes a number of bytes or a size such as '5GB' or '500MiB', not "
                              f"{size!r}")
    return count


def write(tensors: dict[str, torch.Tensor], path, max_shard_size=SHARD_SIZE, metadata: dict | None = None) -> Path:
    """Write ``tensors`` (in their order) as ``path`` (``<name>.safetensors``) if they fit in one file of
    ``max_shard_size`` (None: any size), else as shards ``<name>-00001-of-0000N.safetensors``, each
    of at most that size (a larger tensor alone), and their index ``<name>.safetensors.index.json``.
    Each file is written under a temporary name and renamed, the index last; then what an earlier
    write left at ``path`` that is not part of this one (the one file, the index, other shards) is
    removed. Returns what to read them from: the file or the index."""
    path = Path(path)
    limit = None if max_shard_size is None else size_in_bytes(max_shard_size)
    groups: list[list[str]] = [[]]
    size = 0
    for name in tensors:
        size += _size(tensors, [name])
        if limit is not None and groups[-1] and size > limit:
            groups.append([])
            size = _size(tensors, [name])
        groups[-1].append(name)
    stem = path.name.removesuffix(".safetensors")
    index = path.with_name(stem + INDEX)
    shards = {path: groups[0]} if len(groups) == 1 else {
        path.with_name(f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors"): group for i, group in enumerate(groups)}
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", **(metadata or {})}
    for file, group in shards.items():
        _replace(file, lambda temporary, group=group: safetensors.torch.save_file(
            {name: tensors[name] for name in group}, temporary, metadata=metadata))
    if len(shards) > 1:
        table = {"metadata": {"total_size": _size(tensors, tensors),
                              "total_parameters": sum(tensor.numel() for tensor in tensors.values())},
                 "weight_map": {name: file.name for file, group in shards.items() for name in group}}
        _replace(index, lambda temporary: temporary.write_text(json.dumps(table, indent=2)))
    ours = re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}}\.safetensors|\.safetensors|{re.escape(INDEX)})")
    for stale in path.parent.iterdir():
        if ours.fullmatch(stale.name) and stale not in shards and not (len(shards) > 1 and stale == index):
            stale.unlink(missing_ok=True)
    return path if len(shards) == 1 else index


def _size(tensors: dict[str, torch.Tensor], names) -> int:
    return sum(tensors[name].numel() * tensors[name].element_size() for name in names)


def _replace(file: Path, make) -> None:
    """``make(temporary)`` writes the file, which is then renamed ``file`` (a reader never sees it half written)."""
    temporary = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        make(temporary)
        os.replace(temporary, file)
    finally:
        temporary.unlink(missing_ok=True)


def weight_map(location) -> tuple[dict[str, Path], Path | None]:
    """``({tensor name: the file holding it}, the index that says so or None)`` for the weights at
    ``location``: a ``.safetensors`` file (or its index, if only that is there), an index, or a folder
    (its index, else every ``*.safetensors`` in it). Without an index, each file's header is read."""
    location = Path(location)
    if location.is_dir():
        indexes = sorted(location.glob("*" + INDEX))
        if len(indexes) > 1:
            listed = ", ".join(index.name for index in indexes)
            raise InvalidArgument(f"{location} holds {len(indexes)} safetensors indexes ({listed}): give the one to "
                                  f"read")
        if indexes:
            return _index(indexes[0]), indexes[0]
        found: dict[str, Path] = {}
        for file in sorted(location.glob("*.safetensors")):
            for name in _header(file):
                found.setdefault(name, file)
        if not found and not any(location.glob("*.safetensors")):
            raise MissingFile(f"no safetensors weights in {location}: {_WAY_OUT}")
        return found, None
    index = location if location.name.endswith(".json") else Path(f"{location}.index.json")
    if location.is_file() and index != location:
        return dict.fromkeys(_header(location), location), None
    if index.is_file():
        return _index(index), index
    raise MissingFile(f"no safetensors weights at {location}: {_WAY_OUT}")


def _index(index: Path) -> dict[str, Path]:
    """``{tensor name: shard}`` from an index, its shards named by file name beside it."""
    try:
        table = json.loads(index.read_text())["weight_map"]
        valid = isinstance(table, dict) and all(isinstance(file, str) and file not in ("", ".", "..")
                                                and Path(file).name == file for file in table.values())
    except (ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        raise WeightsMismatch(f"{index} is not a safetensors index ({{\"weight_map\": {{tensor name: file name of its "
                              f"shard}}}}): {_WAY_OUT}")
    return {name: index.parent / file for name, file in table.items()}


def _header(file: Path) -> list[str]:
    """The tensor names in a safetensors file's header: its first 8 bytes (the header's length) and
    the header, read alone."""
    with open(file, "rb") as handle:
        size, length = os.fstat(handle.fileno()).st_size, int.from_bytes(handle.read(8), "little")
        try:
            header = json.loads(handle.read(length)) if 8 <= size and length <= size - 8 else None
        except ValueError:  # not JSON, or not UTF-8
            header = None
    if not isinstance(header, dict):
        problem = ("it is too short to be one" if size < 8 else f"its header would be {length} bytes, past its end"
                   if length > size - 8 else "its header is not a JSON object")
        raise WeightsMismatch(f"{file} is not a readable safetensors file ({problem}): {_WAY_OUT}")
    return [name for name in header if name != "__metadata__"]


@contextmanager
def _opened(file: Path, device=None):
    """``safe_open(file)``; a file that is not safetensors (or is cut short) is a ``WeightsMismatch`` naming it."""
    try:
        with safe_open(file, framework="pt", device=str(device or "cpu")) as handle:
            yield handle
    except SafetensorError as error:
        raise WeightsMismatch(f"{file} is not a readable safetensors file ({error}): {_WAY_OUT}") from None


def names(location) -> list[str]:
    """Every tensor name in the weights at ``location`` (from the index, or the files' headers)."""
    return list(weight_map(location)[0])


def shards(location, wanted, tied=()) -> dict[Path, list[str]]:
    """``{file: the names read from it}``: the files of the weights at ``location`` that ``read``
    opens for the ``wanted`` names, each name under which it is stored there (its own, or a name
    tied to it: each group in ``tied`` shares one tensor); the other files are never opened."""
    return _plan(location, wanted, tied)[0]


def _plan(location, wanted, tied) -> tuple[dict[Path, list[str]], dict[str, str], Path | None]:
    where, index = weight_map(location)
    aliases = {name: group for group in tied for name in group}
    stored: dict[str, str] = {}
    for name in wanted:
        found = next((alias for alias in (name, *aliases.get(name, ())) if alias in where), None)
        if found is not None:
            stored[name] = found
    files: dict[Path, list[str]] = {}
    for name in dict.fromkeys(stored.values()):
        files.setdefault(where[name], []).append(name)
    return files, stored, index


def read(location, wanted, tied=(), device=None) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` for the ``wanted`` names found in the weights at ``location`` (a file, an
    index or a folder); each group in ``tied`` shares one tensor (found under any of its names).
    Only the files that hold them are opened (``shards``); one the index names that is not there,
    or that lacks a tensor the index says it holds, is refused by name."""
    files, stored, index = _plan(location, wanted, tied)
    found: dict[str, torch.Tensor] = {}
    for file, keys in files.items():
        if not file.is_file():
            raise MissingFile(f"{index} puts {few(keys)} in {file.name}, which is not in {file.parent}: copy the "
                              f"shards the index names beside it (or give weights whose files are all there)")
        with _opened(file, device) as handle:
            held = set(handle.keys())
            lacking = [key for key in keys if key not in held]
            if lacking:
                raise WeightsMismatch(f"{index or file} puts {few(lacking)} in {file.name}, which does not hold "
                                      f"{'it' if len(lacking) == 1 else 'them'}: the index is not its shards'; give "
                                      f"the index written with them (or save the weights again)")
            found.update((key, handle.get_tensor(key)) for key in keys)
    return {name: found[key] for name, key in stored.items()}


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
              extra: Sequence[str] = (), owner: str = "", hint: str = "") -> None:
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
