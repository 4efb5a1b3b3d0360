"""qgraph: read and edit what happens inside Qwen3.5 / Qwen3.6 models, from exported graphs.

    ig = qgraph.instrument(model, values=["layers.*.layer_output"])
    out = ig(**tokenizer(texts, return_tensors="pt", padding=True))
    out.logits, out["layers.3.layer_output"]
"""
from .families import UnsupportedModel
from .instrument import InstrumentedModel, Output, instrument
from .names import UnavailableValue, UnknownValue
from .support import SupportTable, support

__all__ = ["InstrumentedModel", "Output", "SupportTable", "UnavailableValue", "UnknownValue",
           "UnsupportedModel", "instrument", "support"]
