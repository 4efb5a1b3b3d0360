"""The one program builder: a copy of an exported graph, its catalogue, and the passes a request runs.

Calls, generation and the diagrams all build their graph here. ``Program(model, exported)`` copies
the exported graph (port markers in place) and catalogues every value. ``build(...)`` runs the
pipeline (``passes.pipeline.PIPELINE``, once, in its order) for one request; ``make(names)`` runs its
first pass alone, the rewrites that make on-request values (what a diagram draws).
"""
from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from typing import Any

import torch
from torch.export.graph_signature import InputKind
from torch.fx import Node

from . import compat
from .errors import InvalidArgument, InvalidState, InvalidType
from .values.catalogue import Entry, build_catalogue
from .values.dictionaries import dictionary_entries
from .export import ExportedModel
from .kernels import heap
from .kernels.buffers import BufferPool, reusing
from .model_reads import ModelReads
from .values.locate import Found, Locator, OnRequest
from .passes.base import Build, Request, run_passes
from .passes.edit import EditSlot
from .rewrites.on_request import input_name
from .passes.pipeline import PIPELINE, build_passes
from .runners import EAGER

InputSource = Callable[[dict], Any]  # a program input's tensor (or constant), from a call's prepared inputs


class Program:
    """A copy of an exported graph with its catalogue; ``build`` runs the passes for a request."""

    def __init__(self, model: torch.nn.Module, exported: ExportedModel, saes: dict | None = None,
                 weights: dict | None = None, device: torch.device | None = None, transcoders: dict | None = None):
        self.model, self.exported, self.family = model, exported, exported.family
        # tensors read instead of the model's (weights loaded for a model on meta), and their device
        self.weights, self.device = weights if weights is not None else {}, device
        self.saes = saes or {}  # {hook value: (SAE, splice)}: their values are made on request (values.dictionaries)
        self.transcoders = transcoders or {}  # {block: (Transcoder, splice)}: likewise
        self.spliced: dict[str, Node] = {}  # the values the splices made: {value name: node}
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(exported.graph, {}))
        attributes = {node.target: getattr(exported.program.graph_module, node.target)
                      for node in graph.find_nodes(op="get_attr")}
        # its code is written once, when ``build`` has run the passes (``make`` alone never runs it)
        self.module = compat.lazy_graph_module(attributes, graph)
        self.module_names = [name for _, name in self.family.ported_modules(model)]
        self.catalogue: dict[str, Entry] = self._catalogue()
        # (placeholder name, function of the call's inputs, how to rebuild it after saving: data or None)
        self.extra_inputs: list[tuple[str, InputSource, dict | None]] = []
        self.slots: dict[str, EditSlot] = {}
        self.passes_run: list[str] = []  # every pass run on this program, in order (for failures to name)
        self.buffers = BufferPool()  # big state buffers kept for the next call (kernels.buffers.BufferPool)
        self.runner = EAGER  # how it runs (qgraph.runners): eager, compiled or staged, chosen by its instrument
        self.model_reads: ModelReads | None = None  # its first inputs, the model's tensors, read in one batch

    @property
    def graph(self) -> torch.fx.Graph:
        return self.module.graph

    @property
    def input_names(self) -> list[str]:
        """The program's inputs (its placeholders), in order."""
        return [node.name for node in self.graph.find_nodes(op="placeholder")]

    @property
    def present(self) -> set[str]:
        """The names this program can serve (a text-only program has no vision values)."""
        present = {name for name, entry in self.catalogue.items() if isinstance(entry.location, (Found, OnRequest))}
        return present | {name for name, entry in self.catalogue.items()
                          if entry.derived and set(self.sources_of(entry)) <= present}

    def _catalogue(self) -> dict[str, Entry]:
        self.locator = Locator(self.graph, self.family, self.model.config)  # ports and scopes, for the diagrams
        entries = build_catalogue(self.family, self.model.config, self.locator, self.module_names)
        return {**entries, **dictionary_entries(entries, self.saes, self.transcoders, self.spliced)}

    def recatalogue(self) -> None:
        """Catalogue the graph again (after a rewrite: a decomposed block's pattern is now found)."""
        self.catalogue = self._catalogue()

    def make(self, names, options: dict[str, dict] | None = None) -> Program:
        """Run the pipeline's first pass alone: the rewrites that make the on-request values among
        ``names``, catalogued again; the markers stay, nothing is tapped (what a diagram reads)."""
        build = Build(self, Request(list(names), options=options or {}))
        run_passes(self.module, build_passes(build, PIPELINE[:1]), self.passes_run)
        return self

    def build(self, values: list[str], slots: dict[str, EditSlot], logits: bool,
              options: dict[str, dict] | None = None, cache: str | None = None, make=(),
              replacement: dict | None = None) -> Program:
        """Run the pipeline (``passes.pipeline.PIPELINE``) for a request: make the values that need a
        rewrite (and those in ``make``, and the SAEs and transcoders that change what the model reads),
        with ``cache`` (``"prompt"`` or ``"decode"``) make the graph a cached decoding step, insert the
        ``slots``, tap the values (and the sources of derived ones),
        strip the markers and drop what no output needs. ``options`` holds per-value options (states'
        positions, heads, dtype). A value asked with ``{"grad": True}`` is also tapped before its view
        (``passes.tap.grad_tap(name)``), the tensor its readers read, so its gradient can be read after a backward.
        ``replacement={block: transcoder}`` builds the replacement model of an attribution graph
        (``passes.replacement``)."""
        spliced = [f"{hook}.sae.features" for hook, (_, splice) in self.saes.items() if splice != "error"] + \
            [f"layers.{i}.transcoder.features" for i, (_, splice) in self.transcoders.items() if splice != "error"]
        request = Request(list(values), dict(slots), logits, options or {}, cache, (*make, *spliced), replacement)
        self.slots = request.slots  # a spliced SAE's features read whether they are edited
        build = Build(self, request)
        run_passes(self.module, build_passes(build), self.passes_run)
        self.tapped, self.returns_logits = build.tapped, logits
        self.derived = {name: self.catalogue[name] for name in values if self.catalogue[name].derived}
        compat.written(self.module)
        self.inputs = _input_sources(self.model, self.exported, self.weights) + \
            [source for _, source, _ in self.extra_inputs]
        self.model_reads = _model_reads(self.model, self.exported)
        return self

    @property
    def derivations(self) -> dict[str, tuple[str, list[str]]]:
        """``{name: (how, sources)}`` of the derived values it serves (``values.derive.fill``)."""
        return {name: (entry.derivation.how, self.sources_of(entry)) for name, entry in self.derived.items()}

    def add_input(self, name: str, source: InputSource, example: torch.Tensor, recipe: dict | None = None) -> Node:
        """A new program input after the existing ones, fed by ``source(call inputs)`` and shaped like
        ``example`` (its fake value lets passes infer shapes). ``recipe`` (JSON data) lets a saved
        program rebuild ``source`` (``rewrites.on_request.input_source``); without one it cannot be saved."""
        with self.graph.inserting_after(self.graph.find_nodes(op="placeholder")[-1]):
            node = self.graph.placeholder(input_name(name))
        fake_mode = next(n.meta["val"].fake_mode for n in self.graph.find_nodes(op="placeholder")
                         if isinstance(n.meta.get("val"), torch.Tensor))
        node.meta["val"] = fake_mode.from_tensor(example)
        self.extra_inputs.append((node.name, source, recipe))
        return node

    @staticmethod
    def sources_of(entry: Entry) -> list[str]:
        """The names a derived value is computed from."""
        return [source.format(host=entry.host) for source in entry.derivation.sources]

    def arguments(self, inputs: dict) -> list:
        """The program's arguments for prepared call inputs: the weights and buffers it reads, then the
        call's tensors; refused by name where a weight this process reads is still on ``meta``."""
        reads = self.model_reads
        if reads is not None and not self.weights:  # the model's own tensors, in one batch (model_reads)
            args = reads.read() + [source(inputs) for source in self.inputs[len(reads):]]
        else:
            args = [source(inputs) for source in self.inputs]
        local = self.runner.local_inputs(len(args))
        unloaded = None
        if any(map(getattr, args, repeat("is_meta"), repeat(False))):  # one C-level pass: every call checks
            unloaded = next((i for i in local if isinstance(args[i], torch.Tensor) and args[i].is_meta), None)
        if unloaded is not None:
            raise InvalidState(f"{self.input_names[unloaded]} is on the meta device (the model was built without "
                               f"weights): load them with ig.load_weights(checkpoint) first")
        return args

    def runs_on(self, runner) -> Program:
        """Run from now on by ``runner`` (``qgraph.runners``: ``Compiled``, ``Staged``; ``EAGER`` by default),
        as the instrument that built it chose."""
        self.runner = runner
        return self

    def run(self, inputs: dict, eager: bool = False, loss=None) -> tuple:
        """Run on prepared program inputs by its runner: (logits or None, {tapped name: tensor}). A
        compiled program runs compiled unless ``eager`` (a call with per-call edits). With ``loss`` (a
        function of the logits to a scalar) the backward runs too, and the loss's value comes third (None
        on a rank without the last stage); with stages and micro-batches the loss is each micro-batch's, summed."""
        try:
            args = self.arguments(inputs)
        except Exception as error:
            self.runner.abandon(error)
            raise
        if loss is not None:
            self._check_loss(loss)
        watched = frozenset(i + self.returns_logits for i, name in enumerate(self.tapped) if name.endswith("#grad"))
        with reusing(self.buffers):  # states land in the memory of earlier calls' dropped states
            results, value = self.runner.run(self, args, loss, watched, eager)
        heap.keep()  # the next call's values land in the memory these leave when dropped (kernels.heap)
        logits = results.pop(0) if self.returns_logits else None
        captured = dict(zip(self.tapped, results))
        return (logits, captured) if loss is None else (logits, captured, value)

    def _check_loss(self, loss) -> None:
        if not callable(loss):
            raise InvalidType(f"loss= takes a function of the logits to a scalar, not {type(loss).__name__}")
        if not self.returns_logits:
            raise InvalidArgument("loss= takes a function of the logits to a scalar: instrument with logits=True")
        if not torch.is_grad_enabled():
            raise InvalidState("loss= runs a backward, which gradients off forbid: call outside torch.no_grad() "
                               "(and torch.inference_mode())")


def _input_sources(model, exported: ExportedModel, weights: dict) -> list[InputSource]:
    """For each program input, a function of the call's inputs giving its tensor (parameters are the
    model's, or those in ``weights``)."""
    sources: list[InputSource] = []
    for spec in exported.program.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            module_path, _, attribute = spec.target.rpartition(".")
            sources.append(_parameter(model.get_submodule(module_path), attribute, spec.target, weights))
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            sources.append(_constant(exported.program.constants[spec.target]))
        elif hasattr(spec.arg, "value"):  # a constant argument
            sources.append(_constant(spec.arg.value))
        else:
            sources.append(_call_input(spec.arg.name))
    return sources


def _model_reads(model, exported: ExportedModel) -> ModelReads | None:
    """The program's leading inputs that are the model's parameters, then its buffers, as one batch read
    (None where the inputs do not start so)."""
    tensors = []
    for spec in exported.program.graph_signature.input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
            break
        module_path, _, attribute = spec.target.rpartition(".")
        tensors.append((model.get_submodule(module_path), attribute, spec.kind == InputKind.PARAMETER))
    kinds = [parameter for _, _, parameter in tensors]
    return ModelReads(tensors) if tensors and kinds == sorted(kinds, reverse=True) else None


def _parameter(module: torch.nn.Module, attribute: str, target: str, weights: dict) -> InputSource:
    """A parameter or buffer: the one in ``weights`` (looked up at each call), else the module's own."""
    return lambda inputs: weights[target] if target in weights else getattr(module, attribute)


def _constant(value) -> InputSource:
    return lambda inputs: value


def _call_input(name: str) -> InputSource:
    return lambda inputs: inputs[name]
