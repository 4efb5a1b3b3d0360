"""``ig.save(path)``: an instrumented program as qgraph's own archive, which runs without the model's code.

What is saved is the text program as the instrument call built it: its taps, its edit slots (each a
``qgraph::edit_slot`` node named by its value, so per-call edits work after loading), its fixed
edits and the SAEs and transcoders spliced in (each module call traced alone into ops,
``saved.inline``). Nothing is exported again: the built fx graph is written as data.

The file (``.qgraph``) is a zip of three members:

- ``qgraph.json``: what the program returns, its slots, the versions that wrote it, the parameters it
  reads (shape and dtype) and the names of every tensor the model had (with the patterns its class
  ignores on load): ``qgraph.load`` refuses weights holding any other, as a strict ``load_state_dict`` would;
- ``graph.json``: the graph, node by node (``saved.fxdata``), and what feeds each of its inputs: a
  parameter of the model by its name, or the call's ``input_ids``, ``attention_mask`` and per-value
  inputs (states' positions and heads, rebuilt on load from ``qgraph.json``);
- ``tensors.safetensors``: the tensors the graph holds: buffers (the rotary frequencies) and what
  qgraph added (SAE and transcoder weights, edit tensors).

It holds no weights (the 0.8B program is under a MB); ``weights=True`` writes the parameters the
program reads beside it (the text program of the image-text model does not read its vision tower's),
tied ones once: as ``<name>.safetensors`` if they fit in one file of ``max_shard_size`` (5 GB unless
told; None: one file however large), else as shards ``<name>-00001-of-0000N.safetensors`` and their
index ``<name>.safetensors.index.json``, as a Hugging Face checkpoint has (``qgraph.weights.write``).
``qgraph.json`` names the file to read them from (the one file or the index).
"""
from __future__ import annotations

import dataclasses
import json
import operator
import os
import zipfile
from importlib import metadata
from pathlib import Path

import safetensors.torch
import torch
from torch.export.graph_signature import InputKind

from ..errors import InvalidArgument, InvalidType, NotSupported
from ..kernels.slot import EDIT_SLOT_OP
from ..passes.edit import EditSlot
from ..rewrites.emit import MethodCall
from ..progress import stages
from ..values.catalogue import entry_data
from ..weights import SHARD_SIZE, size_in_bytes, tensor_names, tied_groups
from ..weights import write as write_weights
from .fxdata import graph_data
from .inline import drop_submodule, free_name, inline_modules
from .sandbox import outside_choices

FORMAT = 5  # 5: the catalogue's facts of its values and slots
SUFFIX = ".qgraph"
META, GRAPH, TENSORS = "qgraph.json", "graph.json", "tensors.safetensors"


def versions() -> dict[str, str]:
    """The versions a saved program records (qgraph and torch must match to load it)."""
    found: dict[str, str] = {"torch": torch.__version__}
    for package in ("qgraph", "transformers"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "unknown"
    return found


def weights_path(path: Path) -> Path:
    """Where ``save(..., weights=True)`` writes the weights of the program at ``path`` when they fit in
    one file (shards: ``<name>-0000i-of-0000N.safetensors`` and ``<name>.safetensors.index.json``)."""
    return path.with_suffix(".safetensors")


def save(ig, path, weights: bool = False, max_shard_size: int | str | None = SHARD_SIZE) -> Path:
    """Write ``ig``'s text program to ``path`` (``.qgraph``), and its weights beside it if ``weights``:
    one ``.safetensors`` file, or shards of at most ``max_shard_size`` (bytes, or ``"5GB"``; None: one
    file) and their index (with a bar of its stages past 2 s: ``qgraph.progress``)."""
    steps = ("trace", *(("write the weights",) if weights is True else ()), "write")
    with stages(f"qgraph: saving {Path(path).name}", steps) as stage:
        return _save(ig, path, weights, max_shard_size, stage)


def _save(ig, path, weights: bool, max_shard_size, stage) -> Path:
    path = Path(path)
    if path.suffix != SUFFIX:
        raise InvalidArgument(f"save to a {SUFFIX} file (qgraph's saved program), not {path.name!r}: "
                              f"e.g. ig.save('probe{SUFFIX}')")
    if not isinstance(weights, bool):
        raise InvalidType(f"weights= takes True (write the weights beside the program) or False, not {weights!r}")
    if max_shard_size is not None:
        size_in_bytes(max_shard_size)  # refused before any work
    ig.refresh()
    program = ig.program_for(False)
    recipes = [recipe for _, _, recipe in program.extra_inputs]
    if any(recipe is None for recipe in recipes):
        raise InvalidArgument("this program takes inputs that cannot be rebuilt after loading (a decode step's cache); "
                              "save a program made by qgraph.instrument")
    if any(tensor.is_meta for tensor in ig.model.parameters()):
        raise InvalidArgument("the model was built on the meta device: a program saved from it would hold its buffers "
                              "and devices as meta and could not run; save from the model loaded with its weights "
                              "(from_pretrained)")
    stage("trace")
    module, slots = _slots_as_ops(program)
    tied = tied_groups(ig.model)
    _untie(module, program, tied)
    try:
        inline_modules(module, _describe)
        inputs, reads = _signature(module, program)
        tensors: dict[str, torch.Tensor] = {}
        data = {"graph": graph_data(module, tensors), "inputs": inputs}
        for node in module.graph.nodes:  # what the loader would refuse (an experts implementation it cannot bound)
            refusal = outside_choices(node)
            if refusal:
                raise NotSupported(f"node {node.name} {refusal}; for the experts, set the model's with "
                                   f"model.set_experts_implementation('grouped_mm') before qgraph.instrument")
    except NotSupported as error:
        raise NotSupported(f"{path.name} cannot be saved: {error}") from error
    data["tensors"] = {name: {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                              "device": str(tensor.device)} for name, tensor in tensors.items()}
    data["placeholders"], data["symbols"] = _placeholders(module, inputs, recipes)
    meta = {
        "format": FORMAT, "versions": versions(), "family": program.family.name,
        "model_class": type(ig.model).__name__, "model_type": ig.config.model_type, "config": ig.config.to_dict(),
        "blocks": len(program.family.block_mixers(ig.config)),
        "vocab_size": ig.model.get_input_embeddings().num_embeddings,
        "logits": program.returns_logits, "outputs": program.tapped, "values": ig.values,
        "layouts": {name: program.catalogue[name].layout for name in program.tapped if name in program.catalogue},
        # what the loaded program resolves names and draws pictures from (values.catalogue.ServedEntry)
        # in the program's catalogue order, so a glob resolves in the order an instrumented model's does
        "catalogue": {name: entry_data(entry) for name, entry in program.catalogue.items()
                      if name in {*ig.values, *slots}},
        "slots": slots, "inputs": recipes,
        "derived": {name: {"how": how, "sources": sources} for name, (how, sources) in program.derivations.items()},
        "parameters": {target: [list(tensor.shape), str(tensor.dtype)] for target, tensor in sorted(reads.items())},
        "weights": None,  # the file to read them from, once written
        "tied": [kept for group in tied if len(kept := [name for name in group if name in reads]) > 1],
        "tensors": tensor_names(ig.model),
        "ignored": sorted(getattr(ig.model, "_keys_to_ignore_on_load_unexpected", None) or []),
    }
    if weights:
        stage("write the weights")
        untied = {target: tensor.detach().contiguous() for target, tensor in reads.items()
                  if not any(target in group[1:] for group in meta["tied"])}
        meta["weights"] = write_weights(untied, weights_path(path), max_shard_size,
                                        metadata={"qgraph": meta["versions"]["qgraph"]}).name
    stage("write")
    _write(path, meta, data, tensors)
    return path


def _write(path: Path, meta: dict, data: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The archive: ``qgraph.json``, ``graph.json`` and the held tensors, written to a temporary name
    and renamed. Each tensor is copied (safetensors refuses tensors that share memory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    held = safetensors.torch.save({name: tensor.detach().clone().contiguous() for name, tensor in tensors.items()})
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp{SUFFIX}")
    with zipfile.ZipFile(temporary, "w") as archive:
        archive.writestr(META, json.dumps(meta, default=str), compress_type=zipfile.ZIP_DEFLATED)
        archive.writestr(GRAPH, json.dumps(data), compress_type=zipfile.ZIP_DEFLATED)
        archive.writestr(TENSORS, held)
    os.replace(temporary, path)


def read_meta(path: Path) -> dict | None:
    """A saved program's ``qgraph.json`` (None if it has none), read without reading the rest and bounded
    before it is read (``saved.schema``)."""
    # lazy: qgraph.saved.schema imports this module's package at import time (a cycle)
    from .schema import parse, read_members
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    if META not in names:  # format 2 (a torch.export archive) kept it as <archive>/extra/qgraph.json
        return {"format": 2} if any(name.endswith(f"/extra/{META}") for name in names) else None
    return parse(read_members(path, (META,))[META], META, path)


def _placeholders(module: _Draft, inputs: list[dict], recipes: list[dict]) -> tuple[list[dict], dict]:
    """Each graph input's shape and dtype, and the range of each symbolic size, which the loader's sandbox
    runs the graph on (``saved.sandbox``). The shapes are qgraph's contract, not read off the graph's
    symbolic sizes (which later passes may have equated with an example's): the call's ``input_ids`` and
    ``attention_mask`` are [batch, seq], a per-value input is as long as its recipe's list, a parameter is
    its own shape. The length is at least what a fixed edit's assertion needs (``saved.inline``)."""
    shapes = []
    for node, item in zip(module.graph.find_nodes(op="placeholder"), inputs):
        value = node.meta.get("val")
        if "parameter" in item:
            shape = list(value.shape)
            if not all(isinstance(size, int) for size in shape):
                raise NotSupported(f"the program's parameter {item['parameter']} has a symbolic size")
        elif item["input"] < 2:
            shape = ["batch", "seq"]
        else:
            recipe = recipes[item["input"] - 2]
            shape = [len(recipe["positions"] if recipe["kind"] == "positions" else recipe["heads"])]
        if value is None or value.dim() != len(shape):
            raise NotSupported(f"the program's input {node.name} is not shaped as a saved program's inputs are")
        shapes.append({"shape": shape, "dtype": str(value.dtype).removeprefix("torch."), "device": str(value.device)})
    least = [node.args[0].args[1] for node in module.graph.find_nodes(
        op="call_function", target=torch.ops.aten._assert_scalar.default)
        if getattr(node.args[0], "target", None) is operator.ge and isinstance(node.args[0].args[1], int)]
    return shapes, {"batch": {"min": 1, "max": None}, "seq": {"min": max([1, *least]), "max": None}}


def _describe(called: torch.nn.Module, target: str) -> str:
    """What a module the program calls is, for an error that it cannot be saved."""
    if isinstance(called, _Fixed):
        return f"the fixed edit {_short(called.slot.fixed)} at {called.slot.target.name}"
    if isinstance(called, MethodCall):
        return f"{type(called.owner).__name__}.{called.method} ({target})"
    return f"the module {target} ({type(called).__name__})"


def _short(edit) -> str:
    """An edit in a few words: ``Add(positions=[2], tensor=...)``, a function by its name."""
    if not dataclasses.is_dataclass(edit):
        return f"<function {getattr(edit, '__qualname__', type(edit).__name__)}>"
    given = {field.name: getattr(edit, field.name) for field in dataclasses.fields(edit)}
    shown = [f"{name}={'...' if isinstance(value, torch.Tensor) else repr(value)}"
             for name, value in given.items() if value is not None]
    return f"{type(edit).__name__}({', '.join(shown)})"


def _signature(module: _Draft, program) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Make the program's buffers and constants tensors the graph holds, drop the parameters it does
    not read; returns what feeds each remaining input (``{"parameter": name}`` or ``{"input": i}``,
    the i-th of input_ids, attention_mask and the per-value inputs) and ``{name: tensor}`` of the
    parameters it reads."""
    graph = module.graph
    specs = program.exported.program.graph_signature.input_specs
    placeholders = graph.find_nodes(op="placeholder")
    first = next(node for node in graph.nodes if node.op != "placeholder")
    inputs, reads, user = [], {}, 0
    for index, node in enumerate(placeholders):
        spec = specs[index] if index < len(specs) else None
        if spec is None or spec.kind == InputKind.USER_INPUT:
            inputs.append({"input": user})
            user += 1
            continue
        if not node.users:
            graph.erase_node(node)
        elif spec.kind == InputKind.PARAMETER:
            inputs.append({"parameter": spec.target})
            reads[spec.target] = program.inputs[index]({})
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            name = free_name(module, node.name)
            module.register_buffer(name, program.inputs[index]({}).detach())
            with graph.inserting_before(first):
                node.replace_all_uses_with(graph.get_attr(name))
            graph.erase_node(node)
        else:
            raise NotSupported(f"the program reads {spec.target or node.name} ({spec.kind.name.lower()}), which a "
                               f"saved program cannot hold")
    return inputs, reads


class _Fixed(torch.nn.Module):
    """A slot's fixed edit alone (what ``EditSlot`` does with no per-call edit), traced into the file."""

    def __init__(self, slot: EditSlot):
        super().__init__()
        self.slot = EditSlot(slot.target, slot.view, fixed=slot.fixed, regions_only=slot.regions_only,
                             reads=slot.reads)

    def forward(self, x, *reads):  # the values the fixed edit reads of the forward (qgraph.Read), traced in
        return self.slot(x, *reads)


class _Draft(torch.nn.Module):
    """A copy of a program's graph with the modules and tensors it reads, made ready to write; never
    compiled to Python (nothing runs it), so each rewrite costs only itself."""

    graph: torch.fx.Graph

    def __init__(self, graph: torch.fx.Graph, source: torch.nn.Module):
        super().__init__()
        self.graph = graph
        for node in graph.nodes:
            if node.op in ("call_module", "get_attr"):
                *path, attribute = node.target.split(".")
                owner = self
                for part in path:
                    if not hasattr(owner, part):
                        owner.add_module(part, torch.nn.Module())
                    owner = getattr(owner, part)
                value = source.get_submodule(node.target) if node.op == "call_module" else \
                    getattr(source.get_submodule(".".join(path)), attribute)
                if isinstance(value, torch.nn.Module):
                    owner.add_module(attribute, value)
                elif isinstance(value, torch.Tensor):
                    owner.register_buffer(attribute, value)
                else:
                    setattr(owner, attribute, value)


def _slots_as_ops(program) -> tuple[_Draft, dict]:
    """A copy of the program's graph whose edit slots are ``qgraph::edit_slot`` nodes (after the
    slot's fixed edit, if any), and ``{name: what the loader needs to rebuild the slot's target}``."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    module = _Draft(graph, program.module)
    slots = {}
    for node in list(graph.find_nodes(op="call_module")):
        slot = module.get_submodule(node.target)
        if not isinstance(slot, EditSlot):
            continue
        name = slot.target.name
        if slot.regions_only:
            raise NotSupported(f"'{name}' is edited inside the delta rule's recurrence, which a saved program's edit "
                               f"slot cannot check: save the program without an edit slot there (reading it is fine)")
        slots[name] = {"layout": slot.target.layout, "dims": list(slot.target.dims),
                       "view": [list(step) for step in slot.view],
                       "fixed": None if slot.fixed is None else repr(slot.fixed)}
        source = node.args[0]
        with graph.inserting_after(node):
            if slot.fixed is not None:
                module.set_submodule(node.target, _Fixed(slot))
                edited = graph.call_function(EDIT_SLOT_OP, (node, name))
                edited.meta["val"] = node.meta.get("val")  # its shape, for the modules that read it (inline)
                node.replace_all_uses_with(edited, delete_user_cb=lambda user, edited=edited: user is not edited)
                continue
            edited = graph.call_function(EDIT_SLOT_OP, (source, name))
            edited.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(edited)
        graph.erase_node(node)
        drop_submodule(module, node.target)
    return module, slots


def _untie(module: _Draft, program, tied: list[list[str]]) -> None:
    """Point each use of a tied parameter at the name its own module reads it by. The export reads
    one name for every use (``lm_head.weight`` for the embedding too); the saved program reads each,
    so a loaded program follows a model whose ``lm_head`` was untied after saving."""
    specs = program.exported.program.graph_signature.input_specs
    placeholders = dict(zip((spec.target for spec in specs), module.graph.find_nodes(op="placeholder")))
    for group in tied:
        nodes = {name: placeholders[name] for name in group if name in placeholders}
        for node in list(nodes.values()):
            for user in list(node.users):
                stack = list((user.meta.get("nn_module_stack") or {}).values())
                owner = next((name for name in nodes if stack and name.rpartition(".")[0] == stack[-1][0]), None)
                if owner is not None:
                    user.replace_input_with(node, nodes[owner])
