"""Every field of a saved program's archive, checked before it is used: the members' sizes (compressed and
inflated) before they are read, then each field of ``qgraph.json`` and ``graph.json`` against what the
writer (``saved.write``) puts there. A refusal is a ``SavedProgramError`` naming the field and why.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

from ..errors import SavedProgramError
from .budget import CONTAINERS, GRAPH_BYTES

META, GRAPH, TENSORS = "qgraph.json", "graph.json", "tensors.safetensors"
# inflated bytes each member may have (graph.json's from the load's budget); the held tensors are stored, never
# compressed (their size is the file's)
SIZES = {META: 32 * 2**20, GRAPH: GRAPH_BYTES, TENSORS: None}
RATIO = 200  # inflated / compressed bytes a JSON member may have (JSON of a graph deflates ~10x)


def read_members(path: Path, names: tuple[str, ...]) -> dict[str, bytes]:
    """The archive members ``names`` of ``path``, each bounded before it is read (``SIZES``, ``RATIO``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = {info.filename: info for info in archive.infolist()}
            extra = sorted(set(infos) - {META, GRAPH, TENSORS})
            if extra:
                raise SavedProgramError(f"{path}: the archive holds {', '.join(map(repr, extra[:5]))}, which a saved "
                                        f"program does not have (it holds {META}, {GRAPH} and {TENSORS})")
            found = {}
            for name in names:
                if name not in infos:
                    raise SavedProgramError(f"{path} is not a whole saved program: it has no {name}")
                found[name] = _member(archive, infos[name], path)
            return found
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError) as error:
        raise SavedProgramError(f"{path} is not a saved program ({type(error).__name__}: {error})") from None


def _member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> bytes:
    limit = SIZES[info.filename]
    if limit is None:
        if info.compress_type != zipfile.ZIP_STORED:
            raise SavedProgramError(f"{path}: its {info.filename} is compressed; a saved program stores it as is")
        limit = info.compress_size
    elif info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise SavedProgramError(f"{path}: its {info.filename} is compressed by method {info.compress_type}, which a "
                                f"saved program does not use")
    if info.file_size > limit or info.file_size > RATIO * max(info.compress_size, 1) + 4096:
        raise SavedProgramError(f"{path}: its {info.filename} inflates to {info.file_size:,} bytes from "
                                f"{info.compress_size:,}, more than a saved program's (at most {limit:,})")
    with archive.open(info) as member:
        data = member.read(info.file_size + 1)  # never past what the header says, whatever the stream holds
    if len(data) != info.file_size:
        raise SavedProgramError(f"{path}: its {info.filename} is not the size its header says")
    return data


def parse(data: bytes, name: str, path: Path) -> dict:
    """The JSON object of member ``name`` (its bytes ``data``), or a ``SavedProgramError`` saying why not;
    one of more lists and objects than ``budget.CONTAINERS`` allows is refused before it is parsed."""
    containers = data.count(b"[") + data.count(b"{")  # an over-count (brackets in strings): never an under-count
    if containers > CONTAINERS.get(name, containers):
        raise SavedProgramError(f"{path}: its {name} holds {containers:,} JSON lists and objects, more than a saved "
                                f"program's ({CONTAINERS[name]:,})")
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise SavedProgramError(f"{path}: its {name} is not JSON ({type(error).__name__}: "
                                f"{str(error)[:100]})") from None
    if not isinstance(value, dict):
        raise SavedProgramError(f"{path}: its {name} is not a JSON object")
    return value


# -- the fields --------------------------------------------------------------------------------------


class _Fields:
    """Checks of one JSON object's fields, each refusal naming ``where`` and the field."""

    def __init__(self, data: dict, where: str):
        self.data, self.where = data, where

    def fail(self, field: str, why: str):
        raise SavedProgramError(f"{self.where}: its field {field!r} {why}")

    def get(self, field: str, check, what: str):
        if field not in self.data:
            self.fail(field, f"is missing (it holds {what})")
        value = self.data[field]
        if not check(value):
            self.fail(field, f"is not {what}: {str(value)[:80]}")
        return value


def _text(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 4096


def _texts(value) -> bool:
    return isinstance(value, list) and all(map(_text, value))


def _count(low: int, high: int):
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _dict_of(check):
    return lambda value: isinstance(value, dict) and all(_text(key) and check(item) for key, item in value.items())


def _shape(value) -> bool:
    return isinstance(value, list) and len(value) <= 16 and all(_count(0, 2**40)(size) for size in value)


def _dtype(value) -> bool:
    import torch
    name = value.removeprefix("torch.") if isinstance(value, str) else None
    return name is not None and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype)


def _view(value) -> bool:
    return isinstance(value, list) and all(
        step == ["unsqueeze"] or (isinstance(step, list) and len(step) == 3 and step[0] == "unflatten"
                                  and all(map(_count(1, 2**31), step[1:]))) for step in value)


def _slot(value) -> bool:
    return isinstance(value, dict) and set(value) == {"layout", "dims", "view", "fixed"} and \
        isinstance(value["layout"], str) and _texts(value["dims"]) and _view(value["view"]) and \
        (value["fixed"] is None or _text(value["fixed"]))


def _facts(value) -> bool:
    from ..values.catalogue import FACTS
    words = lambda v: isinstance(v, str) and len(v) <= 4096  # noqa: E731 — a port's layout may be ""
    sizes = lambda v: isinstance(v, list) and len(v) <= 16 and all(  # noqa: E731
        _count(0, 2**40)(s) or (isinstance(s, str) and len(s) <= 256) for s in v)
    return isinstance(value, dict) and set(value) == set(FACTS) and all(map(words, (
        value["host"], value["layout"], value["description"], value["availability"]))) and sizes(value["dims"]) \
        and sizes(value["shape"]) and all(isinstance(value[k], bool) for k in ("port", "by_name_only", "available")) \
        and (value["reason"] is None or words(value["reason"]))


def _recipe(value) -> bool:
    if not isinstance(value, dict):
        return False
    indices = lambda items: isinstance(items, list) and len(items) <= 65536 and all(  # noqa: E731
        _count(-2**31, 2**31)(item) for item in items)
    if value.get("kind") == "positions":
        return set(value) == {"kind", "value", "positions"} and _text(value["value"]) and indices(value["positions"])
    return value.get("kind") == "heads" and set(value) == {"kind", "heads"} and indices(value["heads"])


def bare_file_name(value) -> bool:
    """A file name beside the program: no folder, no way out of it."""
    return _text(value) and value not in (".", "..") and not any(c in value for c in "/\\\0:") and \
        value.endswith((".safetensors", ".safetensors.index.json"))


def check_meta(meta: dict, where: str) -> None:
    """Every field of ``qgraph.json`` (its format and versions are checked first, by ``read``)."""
    from ..families import FAMILIES
    from ..values.derive import DERIVATIONS
    fields = _Fields(meta, f"{where} ({META})")
    fields.get("versions", lambda v: _dict_of(_text)(v) and {"torch", "qgraph"} <= set(v), "the versions that wrote it")
    families = {family.name: family for family in FAMILIES}
    family = families.get(fields.get("family", _text, "the name of a family"))
    if family is None:
        fields.fail("family", f"names no family of this qgraph ({', '.join(families)})")
    from transformers import CONFIG_MAPPING
    if fields.get("model_type", _text, "a model_type") not in CONFIG_MAPPING:
        fields.fail("model_type", "names no model_type this transformers knows (its config is rebuilt from it)")
    fields.get("model_class", lambda v: _text(v) and v.isidentifier(), "a class name")
    fields.get("config", _dict_of(lambda v: True), "the model's config")
    if any(key.startswith("__") or not key.isidentifier() for key in meta["config"]):
        fields.fail("config", "names an attribute no config has (a dunder, or not an identifier)")
    fields.get("blocks", _count(1, 100_000), "the number of blocks")
    fields.get("vocab_size", _count(1, 2**31), "the vocabulary's size")
    fields.get("logits", lambda v: isinstance(v, bool), "true or false")
    fields.get("outputs", _texts, "a list of value names")
    fields.get("values", _texts, "a list of value names")
    fields.get("layouts", _dict_of(_text), "the layout of each value")
    fields.get("slots", _dict_of(_slot), "the edit slots ({layout, dims, view, fixed})")
    fields.get("catalogue", _dict_of(_facts), "the facts of each value and slot (values.catalogue.FACTS)")
    fields.get("inputs", lambda v: isinstance(v, list) and all(map(_recipe, v)), "the per-value inputs' recipes")
    derived = fields.get("derived", _dict_of(lambda v: isinstance(v, dict) and set(v) == {"how", "sources"} and
                                             _text(v["how"]) and _texts(v["sources"])), "the derived values")
    for name, rule in derived.items():
        if rule["how"] not in DERIVATIONS:
            fields.fail("derived", f"derives {name!r} by {rule['how']!r}, which is no derivation of this qgraph")
    fields.get("parameters", _dict_of(lambda v: isinstance(v, list) and len(v) == 2 and _shape(v[0]) and _dtype(v[1])),
               "the shape and dtype of each parameter it reads")
    fields.get("weights", lambda v: v is None or bare_file_name(v),
               "null or the name of a .safetensors file (or index) beside the program")
    fields.get("tied", lambda v: isinstance(v, list) and all(map(_texts, v)), "the groups of tied parameters")
    fields.get("tensors", _texts, "the names of the model's tensors")
    fields.get("ignored", _texts, "the patterns of tensors its class ignores")


def check_graph_fields(data: dict, meta: dict, where: str) -> None:
    """Every field of ``graph.json`` but the nodes (``fxdata`` reads those), against ``qgraph.json``."""
    fields = _Fields(data, f"{where} ({GRAPH})")
    extra = sorted(set(data) - {"graph", "inputs", "tensors", "placeholders", "symbols"})
    if extra:
        fields.fail(extra[0], "is not a field of a saved program's graph.json")
    fields.get("graph", lambda v: isinstance(v, dict), "the graph's nodes")
    given = 2 + len(meta["inputs"])  # input_ids, attention_mask, the per-value inputs
    fields.get("inputs", lambda v: isinstance(v, list) and all(
        isinstance(item, dict) and len(item) == 1 and (_count(0, given - 1)(item.get("input")) or
                                                       item.get("parameter") in meta["parameters"]) for item in v),
        f"what feeds each input: {{\"input\": 0..{given - 1}}} or {{\"parameter\": a parameter of qgraph.json}}")
    fields.get("tensors", _dict_of(lambda v: isinstance(v, dict) and set(v) == {"shape", "dtype", "device"} and
                                   _shape(v["shape"]) and _dtype(v["dtype"]) and _text(v["device"])),
               "the shape, dtype and device of each held tensor")
    symbols = fields.get("symbols", _dict_of(lambda v: isinstance(v, dict) and set(v) == {"min", "max"} and
                                             _count(0, 2**40)(v["min"]) and
                                             (v["max"] is None or _count(0, 2**40)(v["max"]))),
                         "each symbolic size's range")
    size = lambda s: _count(0, 2**40)(s) or (isinstance(s, str) and s in symbols)  # noqa: E731
    places = fields.get("placeholders", lambda v: isinstance(v, list) and all(
        isinstance(p, dict) and set(p) == {"shape", "dtype", "device"} and _text(p["device"]) and
        isinstance(p["shape"], list) and
        len(p["shape"]) <= 16 and all(map(size, p["shape"])) and _dtype(p["dtype"]) for p in v),
        "each input's shape, dtype and device")
    if len(places) != len(data["inputs"]):
        fields.fail("placeholders", f"has {len(places)} entries for {len(data['inputs'])} inputs")
    for item, place in zip(data["inputs"], places):
        shape, dtype = meta["parameters"].get(item.get("parameter"), (None, ""))
        if "parameter" in item and [place["shape"], place["dtype"]] != [shape, dtype.removeprefix("torch.")]:
            fields.fail("placeholders", f"shapes the parameter {item['parameter']} as {place['shape']} "
                                        f"{place['dtype']}, not as qgraph.json does")
