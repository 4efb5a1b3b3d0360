"""Model families: which rule finds which value, per family, as data.

Each family file builds one ``Family`` (the schema in ``base.py``); ``family_for`` picks a model's.
"""
from __future__ import annotations

from .base import Family, Images, Memory, Mixer, RepeatedBlocks, UnsupportedModel
from .qwen3_5 import QWEN3_5
from .qwen3_5_moe import QWEN3_5_MOE
from .qwen3_next import QWEN3_NEXT

FAMILIES = (QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT)

__all__ = ["FAMILIES", "Family", "Images", "Memory", "Mixer", "RepeatedBlocks", "UnsupportedModel", "family_for"]


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
