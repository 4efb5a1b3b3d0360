"""Model families: which rule finds which value, per family, as data.

A family module (``qwen3_5_text.py``) declares names, module renames, block kinds, layout dims and
its ``VALUES``; ``Family`` wraps such a module with the few lookups the rest of qgraph needs.
"""
from __future__ import annotations

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

    def module_name(self, path: str) -> str:
        """The spec's name of a module path (``model.layers.3.mlp`` -> ``layers.3.mlp``); "" for none."""
        if path in self.data.NO_PORTS:
            return ""
        for prefix, replacement in self.data.MODULE_PREFIXES:
            if path.startswith(prefix):
                return replacement + path[len(prefix):]
        return path

    def block_mixers(self, config) -> list[str]:
        """The mixer module each block carries (``linear_attn`` or ``self_attn``), by block index."""
        text = config.get_text_config()
        return [self.data.MIXERS[kind] for kind in text.layer_types[: text.num_hidden_layers]]

    def dim(self, config, name: str) -> int | None:
        attribute = self.data.DIMS.get(name)
        return None if attribute is None else getattr(config.get_text_config(), attribute)


FAMILIES = (Family(qwen3_5_text),)


def family_for(model) -> Family:
    """The family of ``model``, picked from its text config's ``model_type``."""
    config = getattr(model, "config", None)
    model_type = None
    if config is not None and hasattr(config, "get_text_config"):
        model_type = getattr(config.get_text_config(), "model_type", None)
    for family in FAMILIES:
        if model_type in family.data.MODEL_TYPES:
            return family
    supported = ", ".join(f"{f.name} ({', '.join(f.data.MODEL_TYPES)})" for f in FAMILIES)
    raise UnsupportedModel(
        f"{type(model).__name__} (text model_type {model_type!r}) is not a supported family. "
        f"qgraph supports: {supported} — Qwen3_5ForCausalLM and Qwen3_5ForConditionalGeneration checkpoints.")
