"""``ig.save(path)``: an instrumented program as one ``torch.export`` file that runs without the model's code.

What is saved is the text program as the instrument call built it: its taps, its edit slots (each a
``qgraph::edit_slot`` node named by its value, so per-call edits work after loading) and its fixed
edits (traced into the graph). It is exported again as a plain module whose inputs are the model's
parameters and buffers under their own names, then ``input_ids``, ``attention_mask`` and any
per-value inputs (states' positions and heads, rebuilt on load from ``qgraph.json``).

The file holds no weights: its state dict keeps each of the model's parameters as a one-element
placeholder of the right shape and dtype (the 0.8B program is a few MB). ``weights=True`` writes the
ones the program reads beside it as ``<name>.safetensors`` (the text program of the image-text model
does not read its vision tower's). Buffers (the rotary frequencies) and what qgraph added (SAE
weights, edit tensors) are always in the file. ``qgraph.json`` (an extra file) says what the program
returns, its slots, the versions that wrote it, the parameters it reads, and the names of every tensor
the model had (with the patterns its class ignores on load): ``qgraph.load`` refuses weights holding
any other, as a strict ``load_state_dict`` would.
"""
from __future__ import annotations

import io
import json
import os
import zipfile
import warnings
from importlib import metadata
from pathlib import Path

import safetensors.torch
import torch
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule

from ..errors import InvalidArgument, InvalidType
from ..export.disk_cache import without_weights
from ..export.trace import text_example
from ..kernels.slot import EDIT_SLOT_OP
from ..passes.edit import EditSlot
from ..progress import stages
from ..weights import tensor_names, tied_groups

FORMAT = 2
META = "qgraph.json"


def versions() -> dict[str, str]:
    """The versions a saved program records (qgraph and torch must match to load it)."""
    found = {"torch": torch.__version__}
    for package in ("qgraph", "transformers"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "unknown"
    return found


def weights_path(path: Path) -> Path:
    """Where ``save(..., weights=True)`` writes the weights of the program at ``path``."""
    return path.with_suffix(".safetensors")


def save(ig, path, weights: bool = False) -> Path:
    """Write ``ig``'s text program to ``path`` (``.pt2``), and its weights beside it if ``weights``
    (with a bar of its stages past 2 s: ``qgraph.progress``)."""
    steps = ("export", "write", *(("write the weights",) if weights is True else ()))
    with stages(f"qgraph: saving {Path(path).name}", steps) as stage:
        return _save(ig, path, weights, stage)


def _save(ig, path, weights: bool, stage) -> Path:
    path = Path(path)
    if path.suffix != ".pt2":
        raise InvalidArgument(f"save to a .pt2 file (torch.export's format), not {path.name!r}: e.g. ig.save('probe.pt2')")
    if not isinstance(weights, bool):
        raise InvalidType(f"weights= takes True (write the weights beside the program) or False, not {weights!r}")
    ig.refresh()
    program = ig.program_for(False)
    module, slots = _slots_as_ops(program)
    tied = tied_groups(ig.model)
    _untie(module, program, tied)
    recipes = [recipe for _, _, recipe in program.extra_inputs]
    if any(recipe is None for recipe in recipes):
        raise InvalidArgument("this program takes inputs that cannot be rebuilt after loading (a decode step's cache); "
                              "save a program made by qgraph.instrument")
    if any(tensor.is_meta for tensor in ig.model.parameters()):
        raise InvalidArgument("the model was built on the meta device: a program saved from it would hold its buffers and "
                              "devices as meta and could not run; save from the model loaded with its weights "
                              "(from_pretrained)")
    stage("export")
    holder = _Holder(module, program)
    example, dims = text_example(ig.model)
    device = next(holder.parameters()).device
    example = {name: tensor.to(device) for name, tensor in example.items()}
    extras = [source(example) for _, source, _ in program.extra_inputs]
    dynamic = (dims["input_ids"], dims["attention_mask"], *[None] * len(extras))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(holder, (example["input_ids"], example["attention_mask"], *extras),
                                       dynamic_shapes={"inputs": dynamic}, strict=False)
    specs = [spec for spec in exported.graph_signature.input_specs
             if spec.kind == InputKind.PARAMETER and not spec.target.startswith("program.")]
    model_parameters = {spec.target for spec in specs}
    used = {node.name for node in exported.graph.find_nodes(op="placeholder") if node.users}
    reads = {spec.target for spec in specs if spec.arg.name in used}  # the text program: not the vision tower
    meta = {
        "format": FORMAT, "versions": versions(), "family": program.family.name,
        "model_class": type(ig.model).__name__, "model_type": ig.config.model_type, "config": ig.config.to_dict(),
        "blocks": len(program.family.block_mixers(ig.config)),
        "vocab_size": ig.model.get_input_embeddings().num_embeddings,
        "logits": program.returns_logits, "outputs": program.tapped, "values": ig.values,
        "layouts": {name: program.catalogue[name].layout for name in program.tapped if name in program.catalogue},
        "slots": slots, "inputs": recipes,
        "derived": {name: {"how": how, "sources": sources} for name, (how, sources) in program.derivations.items()},
        "parameters": {target: [list(exported.state_dict[target].shape), str(exported.state_dict[target].dtype)]
                       for target in sorted(reads)},
        "weights": weights_path(path).name if weights else None,
        "tied": [kept for group in tied if len(kept := [name for name in group if name in reads]) > 1],
        "tensors": tensor_names(ig.model),
        "ignored": sorted(getattr(ig.model, "_keys_to_ignore_on_load_unexpected", None) or []),
    }
    stage("write")
    _write(path, without_weights(exported, model_parameters), meta)
    if weights:
        stage("write the weights")
        tensors = {target: exported.state_dict[target].detach().contiguous() for target in reads
                   if not any(target in group[1:] for group in meta["tied"])}
        temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp.safetensors")
        safetensors.torch.save_file(tensors, temporary, metadata={"qgraph": meta["versions"]["qgraph"]})
        os.replace(temporary, weights_path(path))
    return path


def _write(path: Path, exported, meta: dict) -> None:
    """``torch.export.save`` with ``meta`` as the extra file ``qgraph.json``, written to a temporary
    name and renamed (a buffer first, so the archive's folder is torch's default, not the temporary name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the placeholders share no storage with a "complete" tensor
        torch.export.save(exported, buffer, extra_files={META: json.dumps(meta, default=str)})
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp.pt2")
    temporary.write_bytes(buffer.getvalue())
    os.replace(temporary, path)


def read_meta(path: Path) -> dict | None:
    """A saved program's ``qgraph.json`` (None if it has none), read without loading the program:
    ``torch.export.save`` keeps extra files as ``<archive>/extra/<name>`` in its zip."""
    with zipfile.ZipFile(path) as archive:
        name = next((name for name in archive.namelist() if name.endswith(f"/extra/{META}")), None)
        return None if name is None else json.loads(archive.read(name))


class _Fixed(torch.nn.Module):
    """A slot's fixed edit alone (what ``EditSlot`` does with no per-call edit), traced into the file."""

    def __init__(self, slot: EditSlot):
        super().__init__()
        self.slot = EditSlot(slot.target, slot.view, fixed=slot.fixed)

    def forward(self, x):
        return self.slot(x)


def _slots_as_ops(program) -> tuple[GraphModule, dict]:
    """A copy of the program's module whose edit slots are ``qgraph::edit_slot`` nodes (after the
    slot's fixed edit, if any), and ``{name: what the loader needs to rebuild the slot's target}``."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    module = GraphModule(program.module, graph)
    slots = {}
    for node in list(graph.find_nodes(op="call_module")):
        slot = module.get_submodule(node.target)
        if not isinstance(slot, EditSlot):
            continue
        name = slot.target.name
        slots[name] = {"layout": slot.target.layout, "dims": list(slot.target.dims),
                       "view": [list(step) for step in slot.view], "fixed": None if slot.fixed is None else repr(slot.fixed)}
        source = node.args[0]
        with graph.inserting_after(node):
            if slot.fixed is not None:
                module.add_submodule(node.target, _Fixed(slot))
                edited = graph.call_function(EDIT_SLOT_OP, (node, name))
                node.replace_all_uses_with(edited, delete_user_cb=lambda user: user is not edited)
                continue
            edited = graph.call_function(EDIT_SLOT_OP, (source, name))
        node.replace_all_uses_with(edited)
        graph.erase_node(node)
        module.delete_submodule(node.target)
    module.recompile()
    return module, slots


def _untie(module: GraphModule, program, tied: list[list[str]]) -> None:
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
    module.recompile()


class _Holder(torch.nn.Module):
    """The program as a module that holds the model's parameters and buffers under their own names
    (so the export's signature names them as the model does) and takes the call's inputs."""

    def __init__(self, module: GraphModule, program):
        super().__init__()
        self.program = module
        self.order = []  # per program input: (kind, target or value or index)
        user, seen = 0, set()
        for spec, source in zip(program.exported.program.graph_signature.input_specs, program.inputs):
            if spec.kind == InputKind.PARAMETER:
                tensor = source({})
                if id(tensor) in seen:  # tied: an object of its own (same storage), read by this name
                    tensor = torch.nn.Parameter(tensor.detach(), requires_grad=False)
                seen.add(id(tensor))
                _register(self, spec.target, tensor, parameter=True)
                self.order.append(("parameter", spec.target))
            elif spec.kind == InputKind.BUFFER:
                _register(self, spec.target, source({}), parameter=False, persistent=spec.persistent)
                self.order.append(("buffer", spec.target))
            elif spec.kind == InputKind.USER_INPUT:
                self.order.append(("input", user))
                user += 1
            else:
                self.order.append(("constant", source({})))
        self.order += [("input", user + index) for index in range(len(program.extra_inputs))]

    def forward(self, *inputs):
        read = {"parameter": self.get_parameter, "buffer": self.get_buffer,
                "input": inputs.__getitem__, "constant": lambda value: value}
        return tuple(self.program(*(read[kind](what) for kind, what in self.order)))


def _register(root: torch.nn.Module, target: str, tensor: torch.Tensor, parameter: bool, persistent: bool = True) -> None:
    """Put ``tensor`` at the dotted ``target`` under ``root``, making the modules on the way."""
    *path, attribute = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if parameter:
        module.register_parameter(attribute, tensor if isinstance(tensor, torch.nn.Parameter)
                                  else torch.nn.Parameter(tensor, requires_grad=False))
    else:
        module.register_buffer(attribute, tensor, persistent=persistent)
