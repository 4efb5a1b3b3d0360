"""Model families: which rule finds which value, per family, as data.

A family module (``qwen3_5_text.py``) declares names, module renames, block kinds, layout dims and
its ``VALUES``; ``Family`` wraps such a module with the few lookups the rest of qgraph needs.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from types import ModuleType

from . import qwen3_5_text
from .rules import ValueSpec


class UnsupportedModel(TypeError):
    """The model is not of a family qgraph knows."""


@dataclass(frozen=True)
class Family:
    """A family module's data, with the lookups built on it."""

    data: ModuleType

    @property
    def name(self) -> str:
        return self.data.NAME

    @property
    def kernel_module(self) -> str:
        return self.data.KERNEL_MODULE

    @property
    def delta_rule_kernels(self) -> dict[str, str]:
        return self.data.DELTA_RULE_KERNELS

    @property
    def values(self) -> tuple[ValueSpec, ...]:
        return self.data.VALUES

    @functools.lru_cache(maxsize=None)  # asked for every node's module scopes when locating values
    def module_name(self, path: str) -> str:
        """The spec's name of a module path (``model.layers.3.mlp`` -> ``layers.3.mlp``); "" for the
        model itself and its wrappers (``model``, ``model.language_model``)."""
        if path in self.data.NO_PORTS:
            return ""
        for pattern, replacement in self.data.MODULE_RENAMES:
            renamed, count = re.subn(pattern, replacement, path)
            if count:
                return renamed
        return path

    def ported_modules(self, model) -> list[tuple[str, str]]:
        """(path, spec name) of every module that gets ports (``<name>.input``/``.output``): all but
        the model itself and its wrappers."""
        return [(path, self.module_name(path)) for path, _ in model.named_modules() if path not in self.data.NO_PORTS]

    def block_mixers(self, config) -> list[str]:
        """The mixer module each block carries (``linear_attn`` or ``self_attn``), by block index."""
        text = config.get_text_config()
        return [self.data.MIXERS[kind] for kind in text.layer_types[: text.num_hidden_layers]]

    def vision_blocks(self, config) -> int:
        """How many blocks the vision tower has (0 for a text-only model)."""
        vision = getattr(config, "vision_config", None)
        return vision.depth if vision is not None else 0

    def hosts(self, spec_host: str, config) -> list[str]:
        """Every module path hosting values of kind ``spec_host`` on this model."""
        template = self.data.HOSTS[spec_host]
        if spec_host.startswith("vision") and not self.vision_blocks(config):
            return []
        if "{i}" in template:
            mixers = self.block_mixers(config)
            is_mixer = spec_host in self.data.MIXERS.values()
            return [template.format(i=i) for i, mixer in enumerate(mixers) if not is_mixer or mixer == spec_host]
        if "{j}" in template:
            return [template.format(j=j) for j in range(self.vision_blocks(config))]
        return [template]

    def dim(self, config, name: str) -> int | None:
        """The size of a layout dim on this model (None for the call's own sizes, like ``seq``)."""
        source = self.data.DIMS.get(name)
        if source is None:
            return None
        return source(config) if callable(source) else getattr(config.get_text_config(), source)


FAMILIES = (Family(qwen3_5_text),)


def family_for(model) -> Family:
    """The family of ``model``, picked from its text config's ``model_type``."""
    config = getattr(model, "config", None)
    model_type = None
    if config is not None and hasattr(config, "get_text_config"):
        model_type = getattr(config.get_text_config(), "model_type", None)
    for family in FAMILIES:
        if model_type in family.data.MODEL_TYPES:
            if getattr(model, "get_output_embeddings", lambda: None)() is None:
                raise UnsupportedModel(
                    f"{type(model).__name__} is the inner model, without the lm_head that makes logits (an "
                    f"instrumented call would return its last hidden state as logits): instrument the whole "
                    f"model, e.g. the AutoModelForCausalLM you loaded, not model.model")
            return family
    supported = ", ".join(f"{f.name} ({', '.join(f.data.MODEL_TYPES)})" for f in FAMILIES)
    raise UnsupportedModel(
        f"{type(model).__name__} (text model_type {model_type!r}) is not a supported family. "
        f"qgraph supports: {supported} — Qwen3_5ForCausalLM and Qwen3_5ForConditionalGeneration checkpoints.")
