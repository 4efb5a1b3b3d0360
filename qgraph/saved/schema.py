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
from .fields import (Fields, dict_of, dtype_name, either, flag, identifier, integer, list_of, one_of, optional, record,
                     tensor_shape, text)
from ..families import FAMILIES
from ..values.derive import DERIVATIONS

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

_text, _texts = text(), list_of(text())
_size, _shape = integer(0, 2**40), tensor_shape(16, 2**40)


def _unflatten(step) -> bool:
    """``["unflatten", dim, size]``: a step of a slot's view."""
    return isinstance(step, list) and len(step) == 3 and step[0] == "unflatten" and \
        all(map(integer(1, 2**31), step[1:]))


_slot = record({"layout": lambda v: isinstance(v, str), "dims": _texts, "fixed": optional(_text),
                "view": list_of(either(lambda step: step == ["unsqueeze"], _unflatten))})
_indices = list_of(integer(-2**31, 2**31), high=65536)
_recipe = either(record({"kind": lambda v: v == "positions", "value": _text, "positions": _indices}),
                 record({"kind": lambda v: v == "heads", "heads": _indices}))
_words = text(low=0)  # a port's layout may be ""
_sizes = list_of(either(_size, text(256, low=0)), high=16)
# each of values.catalogue.FACTS with its check (a fact added there is refused here until it has one)
FACT_CHECKS = {"host": _words, "layout": _words, "description": _words, "availability": _words, "dims": _sizes,
               "shape": _sizes, "port": flag, "by_name_only": flag, "available": flag, "reason": optional(_words)}
GRAPH_FIELDS = {"graph", "inputs", "tensors", "placeholders", "symbols"}


def _parameter(value) -> bool:
    """``[shape, dtype]``: a parameter the program reads."""
    return isinstance(value, list) and len(value) == 2 and _shape(value[0]) and dtype_name(value[1])


def bare_file_name(value) -> bool:
    """A file name beside the program: no folder, no way out of it."""
    return _text(value) and value not in (".", "..") and not any(c in value for c in "/\\\0:") and \
        value.endswith((".safetensors", ".safetensors.index.json"))


def check_meta(meta: dict, where: str) -> None:
    """Every field of ``qgraph.json`` (its format and versions are checked first, by ``read``)."""
    fields = Fields(meta, f"{where} ({META})")
    fields.get("versions", lambda v: dict_of(_text)(v) and {"torch", "qgraph"} <= set(v), "the versions that wrote it")
    families = {family.name: family for family in FAMILIES}
    family = families.get(fields.get("family", _text, "the name of a family"))
    if family is None:
        fields.fail("family", f"names no family of this qgraph ({', '.join(families)})")
    from transformers import CONFIG_MAPPING
    if fields.get("model_type", _text, "a model_type") not in CONFIG_MAPPING:
        fields.fail("model_type", "names no model_type this transformers knows (its config is rebuilt from it)")
    fields.get("model_class", identifier(), "a class name")
    config = fields.get("config", dict_of(lambda v: True), "the model's config")
    if any(key.startswith("__") or not key.isidentifier() for key in config):
        fields.fail("config", "names an attribute no config has (a dunder, or not an identifier)")
    fields.get("blocks", integer(1, 100_000), "the number of blocks")
    fields.get("vocab_size", integer(1, 2**31), "the vocabulary's size")
    fields.get("logits", flag, "true or false")
    fields.get("outputs", _texts, "a list of value names")
    fields.get("values", _texts, "a list of value names")
    fields.get("layouts", dict_of(_text), "the layout of each value")
    fields.get("slots", dict_of(_slot), "the edit slots ({layout, dims, view, fixed})")
    fields.get("catalogue", dict_of(record(FACT_CHECKS)), "the facts of each value and slot (values.catalogue.FACTS)")
    fields.get("inputs", list_of(_recipe), "the per-value inputs' recipes")
    derived = fields.get("derived", dict_of(record({"how": _text, "sources": _texts})), "the derived values")
    for name, rule in derived.items():
        if rule["how"] not in DERIVATIONS:
            fields.fail("derived", f"derives {name!r} by {rule['how']!r}, which is no derivation of this qgraph")
    fields.get("parameters", dict_of(_parameter), "the shape and dtype of each parameter it reads")
    fields.get("weights", optional(bare_file_name),
               "null or the name of a .safetensors file (or index) beside the program")
    fields.get("tied", list_of(_texts), "the groups of tied parameters")
    fields.get("tensors", _texts, "the names of the model's tensors")
    fields.get("ignored", _texts, "the patterns of tensors its class ignores")


def check_graph_fields(data: dict, meta: dict, where: str) -> None:
    """Every field of ``graph.json`` but the nodes (``fxdata`` reads those), against ``qgraph.json``."""
    fields = Fields(data, f"{where} ({GRAPH})", keys=GRAPH_FIELDS)
    fields.get("graph", lambda v: isinstance(v, dict), "the graph's nodes")
    given = 2 + len(meta["inputs"])  # input_ids, attention_mask, the per-value inputs
    fields.get("inputs", list_of(either(record({"input": integer(0, given - 1)}),
                                        record({"parameter": one_of(meta["parameters"])}))),
               f"what feeds each input: {{\"input\": 0..{given - 1}}} or {{\"parameter\": a parameter of qgraph.json}}")
    fields.get("tensors", dict_of(record({"shape": _shape, "dtype": dtype_name, "device": _text})),
               "the shape, dtype and device of each held tensor")
    symbols = fields.get("symbols", dict_of(record({"min": _size, "max": optional(_size)})),
                         "each symbolic size's range")
    sizes = list_of(either(_size, one_of(symbols)), high=16)
    places = fields.get("placeholders", list_of(record({"shape": sizes, "dtype": dtype_name, "device": _text})),
                        "each input's shape, dtype and device")
    if len(places) != len(data["inputs"]):
        fields.fail("placeholders", f"has {len(places)} entries for {len(data['inputs'])} inputs")
    for item, place in zip(data["inputs"], places):
        shape, dtype = meta["parameters"].get(item.get("parameter"), (None, ""))
        if "parameter" in item and [place["shape"], place["dtype"]] != [shape, dtype.removeprefix("torch.")]:
            fields.fail("placeholders", f"shapes the parameter {item['parameter']} as {place['shape']} "
                                        f"{place['dtype']}, not as qgraph.json does")
