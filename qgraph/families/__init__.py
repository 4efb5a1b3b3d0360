"""Model families: which rule finds which value, per family, as data.

Each family file builds one ``Family`` (the schema in ``base.py``) and registers it
(``registry.register_family``); importing this package imports the family files qgraph ships.
``FAMILIES`` lists the registered families and ``family_for`` picks a model's.
"""
from __future__ import annotations

from ..errors import UnsupportedModel
from .base import Family, Images, Kernels, Memory, Mixer, RepeatedBlocks
from .registry import FAMILIES, family_for, register_family
# the family files qgraph ships: importing each registers its family, in this order
from .qwen3_5 import QWEN3_5
from .qwen3_5_moe import QWEN3_5_MOE
from .qwen3_next import QWEN3_NEXT
from .qwen4_exp import QWEN4_EXP

# the shipped families are public too (``from qgraph.families import QWEN3_5``)
__all__ = ["FAMILIES", "Family", "Images", "Kernels", "Memory", "Mixer", "QWEN3_5", "QWEN3_5_MOE", "QWEN3_NEXT",
           "QWEN4_EXP", "RepeatedBlocks", "UnsupportedModel", "family_for", "register_family"]
