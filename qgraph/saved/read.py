"""``qgraph.load(path, weights=...)``: run a saved program with no model class and no modeling file.

The loaded program is the graph of the instrumented call (``saved.write``), built node by node from
its ``graph.json`` (``saved.fxdata``: only allow-listed ops, nothing in the file runs), holding the
tensors of its ``tensors.safetensors`` and called with the weights (from the file or the shards'
index beside it, a model, a safetensors file or index, or a checkpoint folder: ``qgraph.weights``
opens only the shards holding a tensor it reads) and the call's inputs. It answers calls as the
instrumented model did: an ``Output`` with the logits and the values it was saved with, and
``edits={name: edit}`` at its slots.
A file from another torch or qgraph is refused by name, and so are weights that do not fit it, as a
strict ``load_state_dict`` refuses them: a tensor it reads that they lack or hold in another shape or
dtype, or a tensor that the model it was saved from never had (its ``qgraph.json`` names them all, so
the vision tower's tensors in an image-text checkpoint are expected by the text program that does
not read them). A model given as the weights is followed as ``instrument`` follows it: when its
``fingerprint`` changes (a replaced submodule, untied weights), its parameters are read (and
checked) again.
"""
from __future__ import annotations

import math
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, cast

import safetensors.torch
import torch
from safetensors import SafetensorError

from ..errors import MissingFile, SavedProgramError
from ..progress import stages
from . import sandbox, schema
from .fxdata import device, graph_parts, unbuilt
from .feed import weights_of
from .loaded import LoadedProgram
from .write import FORMAT, GRAPH, META, TENSORS, read_meta, versions

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def load(path, weights=None, *, max_work: float | None = None) -> LoadedProgram:
    """The program saved at ``path``, run with ``weights``: None (the ``.safetensors`` file, or the
    shards' ``.safetensors.index.json``, written beside it by ``save(..., weights=True)``), a model
    (its parameters, read at each call; re-read when a submodule is replaced), a safetensors file, a
    safetensors index (``model.safetensors.index.json`` and its shards), or a folder of them (a
    Hugging Face checkpoint; its index if it has one); only the files holding a tensor it reads are
    opened. Weights that lack a tensor the program reads, or hold one the model it was saved from
    never had, are refused.
    Its work is known at load (``loaded.work(batch, length)``: floating-point operations, ``saved.work``);
    with ``max_work`` a call that would do more is refused before it runs.
    A bar of its stages shows past 2 s (``qgraph.progress``)."""
    with stages(f"qgraph: loading {Path(path).name}", ("read the weights", "load the program")) as stage:
        return _load(path, weights, stage, max_work)


def _load(path, weights, stage, max_work=None) -> LoadedProgram:
    path = Path(path)
    meta, data, module, bounds = check(path)
    bounds.max_work = max_work
    stage("read the weights")
    tensors = weights_of(path, meta, weights)
    stage("load the program")
    # a model given as the weights is followed (its fingerprint reads a transformers model's config)
    model = cast("PreTrainedModel", weights) if isinstance(weights, torch.nn.Module) else None
    return LoadedProgram(path, module, data["inputs"], meta, tensors, model, bounds)


def check(path) -> tuple[dict, dict, torch.fx.GraphModule, sandbox.Bounds]:
    """Everything ``load`` checks of the file at ``path`` before it reads weights (``qgraph check``):
    its ``qgraph.json``, ``graph.json``, the graph module and the bounds of its calls."""
    path = Path(path)
    if not path.is_file():
        raise MissingFile(f"no saved program at {path}: write one with ig.save({str(path)!r})")
    try:
        meta = read_meta(path)
    except zipfile.BadZipFile as error:
        raise SavedProgramError(f"{path} is not a saved program ({type(error).__name__}: {error})") from None
    if meta is None:
        raise SavedProgramError(f"{path} is not a qgraph program (it has no {META}): a plain torch.export file "
                                f"loads with torch.export.load")
    _check_versions(path, meta)
    schema.check_meta(meta, str(path))
    members = schema.read_members(path, (GRAPH, TENSORS))
    data = schema.parse(members[GRAPH], GRAPH, path)
    schema.check_graph_fields(data, meta, str(path))
    held = _held(path, members[TENSORS], data["tensors"])
    graph, attributes = graph_parts(data.pop("graph"), held, str(path))  # its JSON freed before the code compiles
    del members
    if len(graph.find_nodes(op="placeholder")) != len(data["inputs"]):
        raise SavedProgramError(f"{path}: its graph has {len(graph.find_nodes(op='placeholder'))} inputs, "
                                f"graph.json says what feeds {len(data['inputs'])}")
    bounds = sandbox.check(unbuilt(graph, attributes), data["placeholders"], data["symbols"],
                           ["parameter" in item for item in data["inputs"]], str(path))
    elements = sum(math.prod(spec["shape"]) for spec, item in zip(data["placeholders"], data["inputs"])
                   if "parameter" in item) + sum(tensor.numel() for tensor in held.values())
    bounds.check_work_per_weight(elements, str(path))
    return meta, data, torch.fx.GraphModule(attributes, graph), bounds  # its code generated once it passed


def _held(path: Path, data: bytes, expected: dict) -> dict[str, torch.Tensor]:
    """The tensors the graph holds, each as ``graph.json`` says (shape, dtype) on its device."""
    try:
        held = safetensors.torch.load(data)
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise SavedProgramError(f"{path}: its {TENSORS} is not a safetensors file ({str(error)[:200]})") from None
    if set(held) != set(expected):
        odd = sorted(set(held) ^ set(expected))
        raise SavedProgramError(f"{path}: its {TENSORS} holds other tensors than graph.json says "
                                f"({', '.join(odd[:5])})")
    for name, tensor in held.items():
        want = expected[name]
        if list(tensor.shape) != want["shape"] or str(tensor.dtype).removeprefix("torch.") != want["dtype"]:
            raise SavedProgramError(f"{path}: its held tensor {name} is {list(tensor.shape)} "
                                    f"{str(tensor.dtype).removeprefix('torch.')}, graph.json says {want['shape']} "
                                    f"{want['dtype']}")
        held[name] = tensor.to(device(want["device"], f"{path}: held tensor {name}"))
    return held


def _check_versions(path: Path, meta: dict) -> None:
    here = versions()
    if meta.get("format") != FORMAT:
        raise SavedProgramError(f"{path} is qgraph program format {str(meta.get('format'))[:20]}; this qgraph reads "
                                f"format {FORMAT}: save it again with this qgraph")
    written = meta.get("versions")
    for package in ("torch", "qgraph"):
        if not isinstance(written, dict) or not isinstance(written.get(package), str):
            raise SavedProgramError(f"{path} ({META}): its field 'versions' does not name the {package} that wrote it")
        if written[package] != here[package]:
            raise SavedProgramError(f"{path} was saved by {package} {written[package][:40]}; this is {package} "
                                    f"{here[package]}: load it with {package}=={written[package][:40]}, or save it "
                                    f"again with this one (a saved program names the ops of the versions that wrote "
                                    f"it)")


