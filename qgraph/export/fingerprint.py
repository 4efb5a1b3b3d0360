"""What an exported program depends on in a model, to tell when a program went stale.

A program is specialised on the model's structure (module classes, parameter shapes, dtypes and
devices, which parameters are one tensor, the attention and experts implementations) and reads the model's
own module objects at call time. ``structure`` is the first, a key of the export caches;
``fingerprint`` adds the module objects and the plain values the export baked in (a norm's eps, an
attention's scaling, config fields the forward reads: ``qgraph.export.constants``) on every
object of the model, every block's and not only the traced seed blocks', so an instrumented model
notices a replaced submodule, an untied ``lm_head``, a model moved to another dtype or device, or
a changed ``eps`` on any block, and rebuilds its programs (a block left unlike its seed is then
traced apart: ``qgraph.export.variants``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import compat
from . import constants

if TYPE_CHECKING:  # a type only: transformers is imported with the model
    from transformers import PreTrainedModel


def structure(model: PreTrainedModel) -> tuple:
    """Module classes, parameter and buffer shapes / dtypes / devices, tied parameters (each
    parameter names the first path it appears under), attention and experts implementations (the
    model's config's and its text config's: mixture-of-experts ops run the one their experts read)."""
    first: dict[int, str] = {}
    parameters = tuple((name, tuple(p.shape), str(p.dtype), p.device.type, first.setdefault(id(p), name))
                       for name, p in model.named_parameters(remove_duplicate=False))
    buffers = tuple((name, tuple(b.shape), str(b.dtype), b.device.type) for name, b in model.named_buffers())
    modules = tuple((path, f"{type(m).__module__}.{type(m).__qualname__}") for path, m in model.named_modules())
    attention, experts = implementations(model)
    return attention, experts, modules, parameters, buffers


def implementations(model: PreTrainedModel) -> tuple:
    """``(attention, experts)``: the attention implementations of the model's config and its vision
    config, and the experts implementations of its config and its text config."""
    config = model.config
    vision = getattr(config, "vision_config", None)
    attention = (compat.attn_implementation(config), compat.attn_implementation(vision))
    experts = (compat.experts_implementation(config), compat.experts_implementation(config.get_text_config()))
    return attention, experts


def fingerprint(model: PreTrainedModel, reads=()) -> tuple:
    """``structure``, the identity of every module object (a submodule replaced by one of the same
    shape is a new object the program does not read yet) and the values of ``reads``, the plain
    values an export read (``ExportedModel.reads``)."""
    return structure(model), tuple(id(m) for m in model.modules()), constants.current(model, reads)
