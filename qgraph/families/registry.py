"""The registered families, and which one a model is.

A family file registers its family (``QWEN3_5 = register_family(Family(...))``); importing
``qgraph.families`` imports every family file qgraph ships, so ``FAMILIES`` lists them in
registration order and ``family_for`` picks a model's from them.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..errors import InvalidArgument, UnsupportedModel
from .base import Family


class Registry(Sequence):
    """The registered families, in registration order; read-only (``register_family`` adds one)."""

    def __init__(self):
        self._families: list[Family] = []

    def __getitem__(self, index):
        return self._families[index]

    def __len__(self) -> int:
        return len(self._families)

    def __repr__(self) -> str:
        return f"FAMILIES({', '.join(family.name for family in self._families)})"


FAMILIES = Registry()


def register_family(family: Family) -> Family:
    """Register ``family`` (once; registering it again changes nothing) and return it. Refused when
    one of its model_types already belongs to a registered family."""
    if any(known is family for known in FAMILIES):
        return family
    for known in FAMILIES:
        shared = sorted(set(known.model_types) & set(family.model_types))
        if shared:
            raise InvalidArgument(f"family {family.name!r} claims model_type {', '.join(map(repr, shared))}, which the "
                             f"registered family {known.name!r} already has: a model_type loads as one family")
    FAMILIES._families.append(family)
    return family


def family_for(model) -> Family:
    """The family of ``model``, picked from its text config's ``model_type``."""
    config = getattr(model, "config", None)
    model_type = None
    if config is not None and hasattr(config, "get_text_config"):
        model_type = getattr(config.get_text_config(), "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            if getattr(model, "get_output_embeddings", lambda: None)() is None:
                raise UnsupportedModel(
                    f"{type(model).__name__} is the inner model, without the lm_head that makes logits (an "
                    f"instrumented call would return its last hidden state as logits): instrument the whole "
                    f"model, e.g. the AutoModelForCausalLM you loaded, not model.model")
            problem = family.check(config) if family.check else None
            if problem:
                raise UnsupportedModel(f"{type(model).__name__}: {problem}")
            return family
    supported = ", ".join(f"{f.name} ({', '.join(f.model_types)}: {f.classes})" for f in FAMILIES)
    raise UnsupportedModel(
        f"{type(model).__name__} (text model_type {model_type!r}) is not a supported family. "
        f"qgraph supports: {supported} checkpoints.")
