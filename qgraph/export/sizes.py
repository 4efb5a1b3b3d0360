"""The size arithmetic ``torch.export`` writes between ops (on symbolic sizes, never on tensors), by name.

One list for what reads a graph back from data: the disk cache's programs (``export.stored``) and the positive
list of what a saved program may call (``saved.allowed``).
"""
from __future__ import annotations

import math
import operator

import torch

SIZE_FUNCTIONS = {
    **{f"operator.{name}": getattr(operator, name) for name in (
        "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "eq", "ne", "lt",
        "le", "gt", "ge", "and_", "or_", "not_")},
    **{f"math.{name}": getattr(math, name) for name in ("floor", "ceil", "trunc")},
    **{f"torch.{name}": getattr(torch, name) for name in ("sym_float", "sym_int", "sym_max", "sym_min", "sym_not")},
}
