"""Export a Hugging Face model once into a graph with dynamic batch and sequence dims.

Two things happen only while ``torch.export`` traces, and are undone right after:

* the family's delta-rule kernels are routed through ``qgraph.ops`` custom ops, so each kernel
  call is one node and the sequence dim stays dynamic;
* every submodule gets a pre-hook and a hook that wrap its first input and its output in a
  ``qgraph::mark`` node naming the port (``layers.3.mlp.input``). The ports are then exactly what
  forward hooks would read; ``passes.markers`` removes the markers before anything runs.

The user's model is never modified: hooks are removed, module functions restored, and the program
reads the model's own parameter tensors at call time.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import time
import weakref
from dataclasses import dataclass

import torch
from torch.export import Dim, ExportedProgram

from . import ops
from .families import Family, family_for

# Example sizes for the trace; distinct and > 1 so no dim is specialised or unified with another.
_EXAMPLE_BATCH, _EXAMPLE_SEQ = 2, 9


@dataclass
class ExportedModel:
    """A model's forward as one exported program, with its port markers still in the graph."""

    program: ExportedProgram
    family: Family
    seconds: float  # wall time of the export
    key: tuple  # what the program was specialised on (see ``_cache_key``)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.program.graph


_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, ExportedModel]" = weakref.WeakKeyDictionary()


def _cache_key(model: torch.nn.Module) -> tuple:
    parameter = next(model.parameters())
    return (model.config._attn_implementation, parameter.dtype, parameter.device.type)


def export_model(model: torch.nn.Module) -> ExportedModel:
    """Export ``model`` (once per model object and load; later calls reuse the program)."""
    cached = _CACHE.get(model)
    if cached is not None and cached.key == _cache_key(model):
        return cached
    family = family_for(model)
    start = time.perf_counter()
    device = next(model.parameters()).device
    input_ids = torch.zeros(_EXAMPLE_BATCH, _EXAMPLE_SEQ, dtype=torch.long, device=device)
    kwargs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "use_cache": False}
    batch, seq = Dim("batch", min=1), Dim("seq", min=1)
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}, "use_cache": None}
    with _delta_rule_ops(family), _port_markers(model, family):
        program = torch.export.export(model, (), kwargs, dynamic_shapes=dynamic, strict=False)
    exported = ExportedModel(program, family, time.perf_counter() - start, _cache_key(model))
    _CACHE[model] = exported
    return exported


@contextlib.contextmanager
def _delta_rule_ops(family: Family):
    """Route the family's delta-rule kernels (module-level functions) through the custom ops."""
    module = importlib.import_module(family.kernel_module)
    saved = {}
    for kind, function_name in family.delta_rule_kernels.items():
        original = getattr(module, function_name)
        saved[function_name] = original
        ops.KERNELS[kind] = original
        setattr(module, function_name, _as_op(kind))
    try:
        yield
    finally:
        for function_name, original in saved.items():
            setattr(module, function_name, original)


def _as_op(kind: str):
    op = {"chunk": torch.ops.qgraph.chunk_gated_delta_rule,
          "recurrent": torch.ops.qgraph.recurrent_gated_delta_rule}[kind]

    def kernel(query, key, value, g, beta, *args, initial_state=None, use_qk_l2norm_in_kernel=False, **kwargs):
        if initial_state is None:
            # A prompt starts from the zero state; making it a tensor gives state_input a node.
            batch, _, heads, value_dim = value.shape
            initial_state = value.new_zeros(batch, heads, key.shape[-1], value_dim, dtype=torch.float32)
        return op(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel)

    return kernel


@contextlib.contextmanager
def _port_markers(model: torch.nn.Module, family: Family):
    """Wrap every submodule's first input and its output in a named ``qgraph::mark``."""
    handles = []
    for path, module in model.named_modules():
        name = family.module_name(path)
        if not name:
            continue
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
