"""A disk cache of exported programs, shared across processes.

``export_model`` keeps one program per model object in memory; this module keeps them on disk too,
in ``$QGRAPH_CACHE/programs`` (default ``~/.cache/qgraph/programs``), one JSON file per key, in
``export.stored``'s format (``torch.export.load`` of the same program took ten times as long). The
key hashes what the program was specialised on: the model's config (as JSON, without its checkpoint
path), class, dtype, device type, attention and experts implementations, the images flag, the torch,
transformers and qgraph versions and the source of the qgraph modules that shape the export. Set
``QGRAPH_PROGRAM_CACHE=0`` to turn the disk cache off.

No weight is written. A program reads the model's own parameters at call time (see
``program._input_sources``), never ``ExportedProgram.state_dict``, so the file holds each weight's
shape and dtype, and the loaded program's state_dict entries are placeholders that all read one element
(``torch.zeros(()).expand(shape)``): the file is under a MB, not 3 GB. A loaded program is
therefore only for qgraph's passes; its ``.module()`` would compute with zeros.

The file also records the plain values the export read (``qgraph.export.constants``) and their
values then: a model whose eps or scaling has changed since does not load it (it is exported again,
quietly: the file is the same model's under other values). A file that cannot be loaded (corrupt,
written by another torch) or does not fit the model is ignored with a warning; the caller exports
again and overwrites it. Files are written to a
temporary name and renamed, so a concurrent reader never sees half a file.
"""
from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import os
import warnings
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from .. import compat
from . import constants, stored
from .fingerprint import structure

if TYPE_CHECKING:  # a type only: transformers is imported with the model
    from transformers import PreTrainedModel

_READS = "qgraph-reads.json"  # the extra file holding the export's reads and their values

# The qgraph sources whose changes change what export produces (markers, ops, example inputs).
_EXPORT_SOURCES = ("export", "kernels/ops.py", "kernels/experts.py", "inputs.py", "compat", "families")


def enabled() -> bool:
    return os.environ.get("QGRAPH_PROGRAM_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def directory() -> Path:
    """Where programs are cached: ``$QGRAPH_CACHE/programs`` or ``~/.cache/qgraph/programs``."""
    root = os.environ.get("QGRAPH_CACHE") or Path.home() / ".cache" / "qgraph"
    return Path(root) / "programs"


_WARNED: set[Path] = set()  # the files that stand where a cache directory should be, warned about once


def usable() -> bool:
    """Whether the disk cache is on and its directory can be one; when a file stands where it
    should be, warns (one line: the path and the fix) and the caller goes on without the cache."""
    if not enabled():
        return False
    folder = directory()
    blocking = next((path for path in (folder.parent, folder) if path.exists() and not path.is_dir()), None)
    if blocking is None:
        return True
    if blocking in _WARNED:
        return False
    _WARNED.add(blocking)
    variable = "$QGRAPH_CACHE" if os.environ.get("QGRAPH_CACHE") else "the default cache path"
    warnings.warn(f"qgraph: {blocking} is a file, not a directory, so exported programs are not cached on disk: "
                  f"point {variable} at a directory (or set QGRAPH_PROGRAM_CACHE=0)", stacklevel=3)
    return False


def _one_line(text: str, limit: int = 200) -> str:
    """The first line of an error message, at most ``limit`` characters (no traceback in a warning)."""
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def key(model: PreTrainedModel, images: bool) -> str:
    """The hash naming ``model``'s program (``images``: the image-text one) in the cache."""
    parameter = next(model.parameters())
    config = _without_paths(model.config.to_dict())
    vision = getattr(model.config, "vision_config", None)
    parts = {
        "config": config,
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "dtype": str(parameter.dtype),
        "device": parameter.device.type,
        "attn_implementation": compat.attn_implementation(model.config),
        "vision_attn_implementation": compat.attn_implementation(vision),
        "experts_implementation": compat.experts_implementation(model.config.get_text_config()),
        "images": bool(images),
        "structure": structure(model),  # module classes, parameter shapes, tied weights (qgraph.export.fingerprint)
        "training": model.training,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "qgraph": _version("qgraph"),
        "qgraph_source": _source_digest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def path_for(model: PreTrainedModel, images: bool) -> Path:
    return directory() / f"{key(model, images)}.json"


def load(model: PreTrainedModel, images: bool, inputs: tuple[str, ...], finish=None):
    """The cached program of ``model`` and the reads it baked in (None when there is none, or it
    cannot be used); ``finish(program, reads)`` turns the file's program into the model's (the export's
    seed into the full program: see ``qgraph.export.repeat``), None when it cannot."""
    if not usable():
        return None
    path = path_for(model, images)
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_bytes())
        reads = frozenset(tuple(read) for read in recorded["reads"])
        if json.loads(json.dumps(constants.current(model, reads))) != recorded["constants"]:
            return None  # the same model under other baked-in values: export again
        held = safetensors.torch.load(base64.b64decode(recorded["tensors"]))
        program = stored.program_from_data(recorded["program"], held)
        if finish is not None:
            program = finish(program, reads)
        problem = ("it does not repeat into this model's blocks" if program is None
                   else _mismatch(program, model, inputs))
    except Exception as error:  # a corrupt or incompatible file: export again
        problem = _one_line(f"{type(error).__name__}: {error}")
    if problem:
        warnings.warn(f"qgraph: ignoring the cached program {path} ({problem}); exporting again", stacklevel=3)
        return None
    return program, reads


def save(model: PreTrainedModel, images: bool, program: ExportedProgram, reads=frozenset()) -> Path | None:
    """Write ``program`` to the cache without its weights, with the plain values it read (``reads``)
    and their values on ``model``; returns the path (None if it could not)."""
    if not usable():
        return None
    path = path_for(model, images)
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp.json")
    try:
        data, held = stored.program_data(program)
        if any(tensor.is_meta for tensor in held.values()):
            return None  # a model on meta: its program's constants have no values to store, so it is not cached
        recorded = {"reads": sorted(reads), "constants": constants.current(model, reads), "program": data,
                    "tensors": base64.b64encode(safetensors.torch.save(held)).decode()}
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(recorded))
        os.replace(temporary, path)
    except Exception as error:  # a read-only or full disk, or a program the format cannot hold, costs the cache
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        problem = _one_line(f"{type(error).__name__}: {error}")
        warnings.warn(f"qgraph: could not cache the exported program in {path.parent} ({problem}); it is exported "
                      f"again next time", stacklevel=3)
        return None
    return path


def _mismatch(program: ExportedProgram, model: PreTrainedModel, inputs: tuple[str, ...]) -> str | None:
    """Why ``program`` cannot serve ``model`` (None when it can): its inputs, parameters and buffers
    must be the ones the model has, with the same shapes."""
    signature = program.graph_signature
    user_inputs = tuple(spec.arg.name for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT)
    if user_inputs != tuple(inputs):
        return f"its inputs are {user_inputs}, not {tuple(inputs)}"
    for spec in signature.input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
            continue
        module_path, _, attribute = spec.target.rpartition(".")
        try:
            tensor = getattr(model.get_submodule(module_path), attribute)
        except AttributeError:
            return f"the model has no {spec.target}"
        saved = program.state_dict.get(spec.target, program.constants.get(spec.target))
        if saved is not None and (tuple(saved.shape) != tuple(tensor.shape) or saved.dtype != tensor.dtype):
            return (f"{spec.target} is {tuple(saved.shape)} {saved.dtype} there, "
                    f"{tuple(tensor.shape)} {tensor.dtype} here")
    return None


def _without_paths(config: dict) -> dict:
    """The config dict without where it was loaded from (the same model from two paths is one program)."""
    return {name: _without_paths(value) if isinstance(value, dict) else value
            for name, value in config.items() if name not in ("_name_or_path", "_commit_hash", "transformers_version")}


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def _source_digest() -> str:
    package = Path(__file__).parent.parent
    digest = hashlib.sha256()
    for name in _EXPORT_SOURCES:
        location = package / name
        for file in sorted(location.rglob("*.py")) if location.is_dir() else [location]:
            digest.update(file.relative_to(package).as_posix().encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()
