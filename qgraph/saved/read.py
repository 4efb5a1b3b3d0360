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

import copy
import math
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

import safetensors.torch
import torch
from safetensors import SafetensorError

from ..errors import InvalidState, InvalidType, MissingFile, NotSupported, QgraphError, SavedProgramError
from ..edits import EditError, Target
from ..families import FAMILIES
from ..families.configs import config_of
from ..export.fingerprint import fingerprint
from ..inputs import check_text
from ..output import Output
from ..kernels.slot import editing
from ..rewrites.on_request import input_source
from ..progress import stages
from ..values import derive
from ..weights import WeightsMismatch, check_fit, names, read, tensor_names, unexpected
from ..sweep import patch_by_calls
from ..values.catalogue import ServedEntry
from ..values.names import aliases, resolve
from . import sandbox, schema
from .fxdata import device, graph_parts, unbuilt
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
    tensors = _weights(path, meta, weights)
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


def _weights(path: Path, meta: dict, weights) -> dict[str, Callable[[], torch.Tensor]]:
    """``{parameter name: function giving its tensor}`` for the parameters the program reads, checked."""
    if weights is None:
        if meta["weights"] is None:
            raise SavedProgramError(f"{path} was saved without weights: load it with weights=model (the model it was "
                                    f"saved from), a safetensors file or a checkpoint folder, or save it with "
                                    f"ig.save(path, weights=True)")
        weights = path.with_name(meta["weights"])
    try:
        if isinstance(weights, torch.nn.Module):
            return _from_model(path, meta, weights)
        if not isinstance(weights, (str, Path)):
            raise InvalidType(f"weights= takes a model, a safetensors file or index, or a checkpoint folder, not "
                              f"{type(weights).__name__}")
        tensors = read(weights, meta["parameters"], meta["tied"])
        _fit(path, meta, tensors, names(weights), str(weights))
    except WeightsMismatch as error:
        raise SavedProgramError(str(error)) from None
    return {target: _giving(tensor) for target, tensor in tensors.items()}


def _giving(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A function giving ``tensor`` (a weight read from a file: fixed once read)."""
    return lambda: tensor


def _from_model(path: Path, meta: dict, model: torch.nn.Module) -> dict[str, Callable[[], torch.Tensor]]:
    """Functions reading each parameter the program reads from its module of ``model``, at call time."""
    getters: dict[str, Callable[[], torch.Tensor]] = {}
    for target in meta["parameters"]:
        try:
            model.get_parameter(target)
        except AttributeError:
            continue  # missing: named by _fit with the others
        module_path, _, attribute = target.rpartition(".")
        getters[target] = _reading(model.get_submodule(module_path), attribute)
    _fit(path, meta, {target: get() for target, get in getters.items()}, tensor_names(model), "the model")
    if not hasattr(model, "config"):
        raise SavedProgramError(f"weights= takes the model {path.name} was saved from (a transformers model, with a "
                                f"config), not a bare {type(model).__name__}: give its weights as a safetensors file")
    return getters


def _reading(module: torch.nn.Module, attribute: str) -> Callable[[], torch.Tensor]:
    """A function reading ``module``'s ``attribute`` at each call (a parameter replaced since is read)."""
    return lambda: getattr(module, attribute)


def _fit(path: Path, meta: dict, tensors: dict, given: list[str], source: str) -> None:
    """``check_fit`` of ``tensors`` (and the names of every tensor ``given``) against the program."""
    check_fit(path.name, meta["parameters"], tensors, source, unexpected(given, meta["tensors"], meta["ignored"]),
              owner=f"the {meta['model_class']} it was saved from",
              hint=f": give the weights of the model {path.name} was saved from (a {meta['model_class']} of "
                   f"{meta['blocks']} blocks), or save a program from the model these weights are for")


class LoadedProgram:
    """A saved instrumented program, a ``qgraph.Instrument``: call it like the instrumented model
    (``input_ids``, ``attention_mask``, ``edits={name: edit}`` at the slots it was saved with). Its
    catalogue holds the values and slots it was saved with; names resolve over it as an instrumented
    model's do (``values.names.resolve``), and ``variant`` reads some of its values (``{"grad": True}``
    for a value at a slot), so the recipes and pictures run on it."""

    def __init__(self, path: Path, module: torch.fx.GraphModule, inputs: list, meta: dict, weights: dict,
                 model: PreTrainedModel | None = None, bounds: sandbox.Bounds | None = None):
        self.path, self.module, self.meta, self._bounds = path, module, meta, bounds
        self.values: list[str] = meta["values"]
        self.slots: dict[str, Target] = {name: Target(name, slot["layout"], tuple(slot["dims"]))
                                         for name, slot in meta["slots"].items()}
        self._views = {name: tuple(tuple(step) for step in slot["view"]) for name, slot in meta["slots"].items()}
        self._extra = [input_source(recipe) for recipe in meta["inputs"]]
        self._inputs = inputs  # per graph input: {"parameter": name} or {"input": index} (checked: saved.schema)
        # the messages of the graph's assertions of a fixed edit's needs (saved.inline): a call they refuse
        # is an EditError, as the instrumented model's own refusal is
        asserts = module.graph.find_nodes(op="call_function", target=torch.ops.aten._assert_scalar.default)
        self._needs = {node.args[1] for node in asserts if isinstance(node.args[1], str) and node.args[1]}
        self._model = model  # weights=model: followed (see _follow)
        self._use(weights)
        self.config = _config(path, meta)
        self.family = next(family for family in FAMILIES if family.name == meta["family"])  # schema: one of them
        self.blocks = meta["blocks"]
        self.catalogue = {name: ServedEntry.of(name, facts) for name, facts in meta["catalogue"].items()}
        self._logits = meta["logits"]  # whether its calls return the logits (a variant's may not)

    def _use(self, weights: dict) -> None:
        """Feed the program ``weights`` (``{name: function giving the tensor}``) and the call's inputs."""
        seen = None if self._model is None else fingerprint(self._model)
        self._sources = [weights[item["parameter"]] if "parameter" in item else item["input"] for item in self._inputs]
        self._anchor = next(iter(weights.values()), None)  # any weight: where they are
        self._fingerprint = seen

    def _follow(self) -> None:
        """Read the model's parameters again if it changed since they were read (a replaced submodule,
        untied weights, another dtype or device), as ``InstrumentedModel.refresh`` does; weights that
        no longer fit are refused by name."""
        if self._model is not None and fingerprint(self._model) != self._fingerprint:
            self._use(_weights(self.path, self.meta, self._model))

    def work(self, batch: int = 1, length: int = 1) -> float:
        """The floating-point operations a call of ``batch`` prompts of ``length`` tokens does, as the
        sandbox counts them from the graph (contractions' multiply-adds twice, other ops their elements)."""
        ids = torch.empty(batch, length, dtype=torch.long)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        user = [ids, inputs["attention_mask"], *(source(inputs) for source in self._extra)]
        shapes = [user[source].shape if isinstance(source, int) else () for source in self._sources]
        if self._bounds is None:
            raise InvalidState("this program was made without the bounds qgraph.load checks, so its work is unknown: "
                               "load it with qgraph.load(path)")
        return self._bounds.work_at(shapes)

    @property
    def graph(self) -> torch.fx.Graph:
        """The loaded program's ``torch.fx`` graph (what ``qgraph.render`` draws)."""
        return self.module.graph

    def __call__(self, input_ids=None, attention_mask=None, *, edits: Mapping | None = None) -> Output:
        self._follow()
        device = self._anchor().device if self._anchor is not None else torch.device("cpu")
        input_ids, attention_mask = check_text(input_ids, attention_mask, self.meta["vocab_size"], device)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        user = [input_ids, attention_mask, *(source(inputs) for source in self._extra)]
        args = [user[source] if isinstance(source, int) else source() for source in self._sources]
        if self._bounds is not None:
            self._bounds.check(args)
        with editing(self._edits(edits)):
            try:
                results = list(self.module(*args))
            except IndexError as error:  # an index its graph computes past a tensor's end: the file's doing
                raise SavedProgramError(f"{self.path.name} indexes past the end of a tensor at this call "
                                        f"({str(error).splitlines()[0][:200]}): a program ig.save writes does not, so "
                                        f"the file was changed after it was saved; save it again from the model"
                                        ) from None
            except RuntimeError as error:
                need = next((need for need in self._needs if need in str(error)), None)
                if need is None:
                    raise
                raise EditError(f"{need}; this call has {input_ids.shape[1]} tokens") from None
        logits = results.pop(0) if self.meta["logits"] else None
        captured = dict(zip(self.meta["outputs"], results))
        derive.fill(captured, {name: (rule["how"], rule["sources"]) for name, rule in self.meta["derived"].items()},
                    inputs, self.config)
        values = {name: captured[name] for name in self.values if name in captured}
        return Output(logits if self._logits else None, values, self.blocks, aliases=aliases(self.family, self.config),
                      source=self, input_ids=input_ids)

    def resolve(self, patterns) -> list[str]:
        """The names of its values and slots that ``patterns`` select, as an instrumented model selects them."""
        return resolve(patterns, self.catalogue, self.family, self.config) if patterns else []

    def variant(self, values=(), *, edits=(), logits: bool = True) -> LoadedProgram:
        """This program returning ``values`` (some of those it was saved with), editable at ``edits`` (some
        of its slots): what the recipes run."""
        names, slots = self.resolve(values), self.resolve(list(edits))
        if isinstance(values, Mapping) and any((options or {}).get("grad") for options in values.values()):
            raise NotSupported(f"{self.path.name} runs on weights read as plain tensors, so no gradient reaches its "
                               f"values: read gradients (attribution_patch) with qgraph.instrument(model) or on a "
                               f"server")
        lacking = [name for name in names if name not in self.values] + \
            [name for name in slots if name not in self.slots]
        if lacking:
            raise NotSupported(f"{self.path.name} was saved without {', '.join(lacking[:4])} among its values and "
                               f"slots (values {self.values}, slots {list(self.slots)}): save a program that has them "
                               f"(instrument(model, values=..., edits=[...]).save(path))")
        if logits and not self.meta["logits"]:
            raise NotSupported(f"{self.path.name} was saved with logits=False: save it with logits")
        view = copy.copy(self)
        view.values, view._logits = [name for name in names if name in self.values], logits
        return view

    def run_patches(self, clean: dict, corrupt: dict, names: list[str], metric, positions, heads, batch_size) -> dict:
        """``qgraph.patch``'s locations, one call each (a saved program is not cut into blocks)."""
        return patch_by_calls(self, clean, corrupt, names, metric, positions, heads)

    def generate(self, *args, **kwargs):
        """Refused: a saved program is one forward pass, without the cache generation decodes from."""
        raise NotSupported(f"{self.path.name} is one forward pass, saved without a cache: generate with "
                           f"qgraph.instrument(model) or on a server (qgraph serve)")

    def logit_lens(self, *args, **kwargs):
        """Refused: a saved program holds no readout (the final norm and head) to project the blocks' outputs."""
        raise NotSupported(f"{self.path.name} holds no readout of the blocks' outputs (the final norm and head "
                           f"as functions): read the lens with qgraph.instrument(model) or on a server")

    def _edits(self, edits: Mapping | None) -> dict:
        if edits is None:
            return {}
        if not isinstance(edits, Mapping):
            raise InvalidType(f"edits= takes a dict {{name: edit}}, not {type(edits).__name__}")
        chosen = {}
        for pattern, edit in edits.items():
            try:
                names = self.resolve(pattern)
            except QgraphError:
                names = []
            if not names or any(name not in self.slots for name in names):
                raise EditError(f"{pattern!r} is not an edit slot of {self.path.name}; its slots are "
                                f"{', '.join(self.slots) or 'none'} (declare slots with instrument(..., edits=[...]) "
                                f"before saving)")
            for name in names:
                chosen[name] = (edit, self.slots[name], self._views[name])
        return chosen

    def __repr__(self) -> str:
        return (f"LoadedProgram({self.path.name}: {self.meta['model_class']}, {len(self.values)} values, "
                f"slots {list(self.slots)})")


def _config(path: Path, meta: dict):
    """The model's config, rebuilt from its class's configuration file (never its modeling file)."""
    try:
        return config_of(meta["model_type"], meta["config"])
    except Exception as error:  # noqa: BLE001 (any refusal of the config's fields is the file's)
        raise SavedProgramError(f"{path} ({META}): its field 'config' is not a {meta['model_type']} config "
                                f"({type(error).__name__}: {str(error)[:200]})") from None
