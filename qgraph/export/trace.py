"""Export a Hugging Face model once into a graph with dynamic batch and sequence dims.

Two things happen only while ``torch.export`` traces, and are undone right after:

* the family's delta-rule kernels are routed through ``qgraph.kernels.ops`` custom ops, so each kernel
  call is one node and the sequence dim stays dynamic;
* every submodule gets a pre-hook and a hook that wrap its first input and its output in a
  ``qgraph::mark`` node naming the port (``layers.3.mlp.input``). The ports are then exactly what
  forward hooks would read; ``passes.markers`` removes the markers before anything runs;
* for the image-text program, the family's image patches (``Images.patches``: for the Qwen ViT,
  one varlen attention node over all images and packed image features). What depends on the image
  grids in Python is computed before each call (``Images.prepare``) and passed in, so one program
  serves every number and size of images.

The user's model is never modified: hooks are removed, module functions restored, and the program
reads the model's own parameter tensors at call time. The user's own hooks are set aside while
export traces (``compat.hooks_set_aside``), so they never become part of a program.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import time
import types
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.export import Dim, ExportedProgram

from . import constants, disk_cache
from ..kernels import ops
from .. import compat
from ..compat import export_patches, hooks_set_aside
from ..families import Family, family_for
from ..progress import progress, stages
from .fingerprint import structure
from .repeat import Blocks, repeat_blocks, repeated_blocks, seeded
from .variants import split

if TYPE_CHECKING:  # a type only: transformers is imported with the model
    from transformers import PreTrainedModel

# Example sizes for the trace: distinct and > 1, so no dim is specialised or unified with another.
_EXAMPLE_BATCH, _EXAMPLE_SEQ = 2, 9
TEXT_INPUTS = ("input_ids", "attention_mask")


@dataclass
class ExportedModel:
    """A model's forward as one exported program, with its port markers still in the graph."""

    program: ExportedProgram
    family: Family
    seconds: float  # wall time of the export (or of loading it from the disk cache)
    key: tuple  # what the program was specialised on (see ``_cache_key``)
    inputs: tuple[str, ...]  # the program's user inputs, in order (TEXT_INPUTS, then the family's image inputs)
    reads: frozenset = frozenset()  # the plain values the forward read, baked in (``qgraph.export.constants``)
    from_cache: bool = False  # loaded from the disk cache (``qgraph.export.disk_cache``) instead of exported
    constants: tuple = ()  # the reads' values on the model when it was exported (set by ``export_model``)
    apart: tuple[str, ...] = ()  # the blocks traced apart from their kind's first block, and why (``export.variants``)

    def fits(self, model: PreTrainedModel) -> bool:
        """Whether this program still is ``model``'s: the same structure and the same baked-in values."""
        return self.key == _cache_key(model) and self.constants == constants.current(model, self.reads)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.program.graph

    @property
    def images(self) -> bool:
        return self.inputs != TEXT_INPUTS


_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, dict] = weakref.WeakKeyDictionary()


def _cache_key(model: PreTrainedModel) -> tuple:
    return structure(model)


def has_vision(model: PreTrainedModel) -> bool:
    """Whether the model is the image-text wrapper (it has a vision tower)."""
    return family_for(model).vision_blocks(model.config) > 0


def export_model(model: PreTrainedModel, images: bool | None = None) -> ExportedModel:
    """Export ``model`` once per model object, load and kind of program; later calls reuse it.

    ``images`` picks the image-text program (the default for the image-text model) or the
    text-only one (``images=False``: what a text-only call to that model runs). A model exported
    in an earlier process (same config, dtype, versions: see ``qgraph.export.disk_cache``) loads its program
    from the disk cache instead of exporting again.
    """
    family = family_for(model)
    images = has_vision(model) if images is None else images and has_vision(model)
    programs = _CACHE.setdefault(model, {})
    cached = programs.get(images)
    if cached is not None and cached.fits(model):
        return cached
    start = time.perf_counter()
    part = family.images if images else None  # not None where images: has_vision asks the family's image part
    names = TEXT_INPUTS + part.inputs if part is not None else TEXT_INPUTS
    blocks = repeated_blocks(model, family, images)
    apart: list[str] = []  # the blocks traced apart from their kind's first, and why (qgraph.export.variants)

    def full(program: ExportedProgram, reads) -> ExportedProgram | None:
        """The seed ``program``, whose trace read ``reads``, repeated into the full program."""
        apart.clear()
        for listed in blocks:
            listed = split(model, listed, reads)  # the seeds that trace held
            apart.extend(listed.apart)
            repeated = repeat_blocks(program, model, family, listed)
            if repeated is None:
                return None
            program = repeated
        return program

    # an export of the same model in an earlier process (its seed: see qgraph.export.repeat)
    with progress(f"qgraph: loading {type(model).__name__}'s exported program from the cache"):
        loaded = disk_cache.load(model, images, names, full)
    if loaded is not None:
        program, reads = loaded
        _use_kernels(program, family)
        return _keep(programs, images, model, ExportedModel(program, family, time.perf_counter() - start,
                                                            _cache_key(model), names, reads, True, apart=tuple(apart)))
    saving = ("save to the cache",) if disk_cache.enabled() else ()
    with stages(f"qgraph: exporting {type(model).__name__}", ("trace", "repeat blocks", *saving)) as stage:
        stage("trace")  # torch.export of one block per kind (the bar shows past 2 s)
        # a rebuild (the model changed since): what its last export read tells at once which blocks differ
        seed, reads = _export_seeds(model, family, images, names, blocks, cached.reads if cached else frozenset())
        stage("repeat blocks")
        program = full(seed, reads) if seed is not None else None
        repeated = program is not None
        if not repeated:  # the blocks did not repeat cleanly: trace them all
            stage("trace every block")
            program, reads = _export(model, family, images, names, [])
            apart.clear()
        exported = ExportedModel(program, family, time.perf_counter() - start, _cache_key(model), names, reads,
                                 apart=tuple(apart))
        if repeated and saving:  # the file holds the seed (a full export would not repeat when loaded)
            stage("save to the cache")
            disk_cache.save(model, images, seed, reads)
    return _keep(programs, images, model, exported)


def _export_seeds(model, family: Family, images: bool, names: tuple[str, ...], blocks: list[Blocks], predicted):
    """The seed export of ``blocks`` and the plain values it read, ``(None, reads)`` if its seeds do not
    settle. A block unlike its kind's first in what the trace reads is a seed of its own
    (``qgraph.export.variants``); which values those are is known after a trace, so where the reads
    split blocks otherwise than the trace's seeds did, the seeds are traced again (``predicted``:
    the reads of an earlier export of this model, which tell at once where a rebuild's blocks differ)."""
    listed = [split(model, listed, predicted) for listed in blocks]
    for _ in range(3):
        seed, reads = _export(model, family, images, names, listed)
        settled = [split(model, listed, reads) for listed in blocks]
        if settled == listed:
            return seed, reads
        listed = settled
    return None, reads


def _keep(programs: dict, images: bool, model: PreTrainedModel, exported: ExportedModel) -> ExportedModel:
    exported.constants = constants.current(model, exported.reads)
    programs[images] = exported
    return exported


def _export(model, family: Family, images: bool, names: tuple[str, ...], blocks: list[Blocks]):
    """``torch.export`` of the model's twin, whose block lists in ``blocks`` hold their seed blocks only,
    and the plain values its forward read (``qgraph.export.constants``)."""
    part = family.images if images else None  # the image part, for the image-text program
    example, dynamic = part.example(model) if part is not None else text_example(model)
    twin = _with_signature(model, names, {**family.forward_kwargs, **(part.forward_kwargs if part is not None else {})})
    for listed in blocks:
        twin = seeded(twin, listed)
    # the user's hooks are never traced: the program would run them forever (and on every repeated block)
    patches = part.patches(model) if part is not None else contextlib.nullcontext()
    family_patches = family.export_patches(model) if family.export_patches else contextlib.nullcontext()
    with hooks_set_aside(model), export_patches(model, family.export_methods), _delta_rule_ops(model, family), \
            _port_markers(model, family), family_patches, patches, \
            constants.recording(twin) as reads:
        program = compat.export(twin, example, dynamic, named=family.named_dims)
    return program, frozenset(read for read in reads if read[1] not in family.cache_indices)


def _with_signature(model: PreTrainedModel, names: tuple[str, ...], forward_kwargs: dict) -> torch.nn.Module:
    """A shallow twin of ``model`` (same submodules, parameters and hooks) whose forward takes
    exactly ``names`` as tensors (and ``forward_kwargs``); the model itself is not touched."""
    twin = copy.copy(model)
    model_forward = type(model).forward
    extra = {"use_cache": False, **forward_kwargs}

    def forward(self, *args, **kwargs):
        return model_forward(self, **dict(zip(names, args)), **kwargs, **extra)

    parameters = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    # inspect.signature (and so torch.export) reads a function's __signature__, which typeshed does not declare
    forward.__signature__ = inspect.Signature([self_parameter, *parameters])  # type: ignore[attr-defined]
    twin.forward = types.MethodType(forward, twin)
    return twin


def text_example(model):
    device = next(model.parameters()).device
    input_ids = torch.zeros(_EXAMPLE_BATCH, _EXAMPLE_SEQ, dtype=torch.long, device=device)
    batch, seq = Dim("batch", min=1), Dim("seq", min=1)
    example = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    return example, {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}


@contextlib.contextmanager
def _delta_rule_ops(model: PreTrainedModel, family: Family):
    """Route the family's delta-rule kernels (module-level functions) through the custom ops, each
    op naming the kernels it runs (``ops.register_kernels``), so the program carries them."""
    module = importlib.import_module(family.kernels.module)
    saved = {kind: getattr(module, name) for kind, name in family.kernels.functions.items()}
    kernels = ops.register_kernels(family.kernels.module, saved)
    for kind, name in family.kernels.functions.items():
        setattr(module, name, _as_op(kind, kernels))
    try:
        with compat.kernels_bound(model, {saved[kind]: _as_op(kind, kernels) for kind in saved}):
            yield
    finally:
        for kind, name in family.kernels.functions.items():
            setattr(module, name, saved[kind])


def _use_kernels(program: ExportedProgram, family: Family) -> None:
    """A program loaded from the disk cache runs the kernels the family's module has in this process:
    its delta-rule nodes are pointed at them (the file names the exporting process's)."""
    module = importlib.import_module(family.kernels.module)
    kernels = ops.register_kernels(family.kernels.module, {kind: getattr(module, name)
                                                           for kind, name in family.kernels.functions.items()})
    for node in program.graph.nodes:
        if node.target in ops.DELTA_RULE_OPS:
            node.update_arg(len(node.args) - 1, kernels)


def _as_op(kind: str, kernels: str):
    op = {"chunk": torch.ops.qgraph.chunk_gated_delta_rule,
          "recurrent": torch.ops.qgraph.recurrent_gated_delta_rule}[kind]

    def kernel(query, key, value, g, beta, *args, initial_state=None, use_qk_l2norm_in_kernel=False, **kwargs):
        if initial_state is None:
            # A prompt starts from the zero state; making it a tensor gives state_input a node.
            batch, _, heads, value_dim = value.shape
            initial_state = value.new_zeros(batch, heads, key.shape[-1], value_dim, dtype=torch.float32)
        return op(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel, kernels)

    return kernel


@contextlib.contextmanager
def _port_markers(model: PreTrainedModel, family: Family):
    """Wrap every submodule's first input and its output in a named ``qgraph::mark``."""
    handles = []
    for path, name in family.ported_modules(model):
        module = model.get_submodule(path)
        first_parameter = next(iter(inspect.signature(module.forward).parameters), None)
        handles.append(module.register_forward_pre_hook(
            _mark_input(f"{name}.input", first_parameter), with_kwargs=True))
        handles.append(module.register_forward_hook(_mark_output(f"{name}.output")))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _mark_input(port: str, first_parameter: str | None):
    def hook(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return (ops.mark(args[0], port), *args[1:]), kwargs
        if isinstance(kwargs.get(first_parameter), torch.Tensor):
            return args, {**kwargs, first_parameter: ops.mark(kwargs[first_parameter], port)}
        return None
    return hook


def _mark_output(port: str):
    def hook(module, args, output):
        if isinstance(output, torch.Tensor):
            return ops.mark(output, port)
        if type(output) is tuple and output and isinstance(output[0], torch.Tensor):
            return (ops.mark(output[0], port), *output[1:])  # a module returning (tensor, extras)
        return None
    return hook
