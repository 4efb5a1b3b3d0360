"""qgraph: read and edit what happens inside Qwen3.5 / Qwen3.6 models, from exported graphs.

    ig = qgraph.instrument(model, values=["layers.*.layer_output"])
    out = ig(**tokenizer(texts, return_tensors="pt", padding=True))
    out.logits, out["layers.3.layer_output"]
"""
from .kernels import grad as _autograd  # noqa: F401  (registers the custom ops' autograd)
from .kernels import experts as _experts  # noqa: F401  (registers qgraph::moe_experts, which MoE programs call)
from .kernels import slot as _slot  # noqa: F401  (registers qgraph::edit_slot, which saved programs call)
from .compat import check_versions
from .capture import CaptureCorrupt, CaptureMismatch, capture, load_capture
from .edits import Add, Edit, EditError, Replace, Scale, Zero
from .families import UnsupportedModel
from .generate import GenerateOutput, chat_prompt
from .instrument import InstrumentedModel, Output, instrument
from .values.names import UnavailableValue, UnknownValue
from .recipes import attribution_patch, expert_neurons, patch, skip_layers, steer
from .saes import SAE
from .saved import LoadedProgram, SavedProgramError, load
from .distributed import Stages
from .render import render
from .values.support import SupportTable, support

__all__ = ["Add", "attribution_patch", "capture", "CaptureCorrupt", "CaptureMismatch", "load_capture", "Edit", "EditError", "expert_neurons", "GenerateOutput", "InstrumentedModel", "LoadedProgram", "Output", "Replace", "SAE", "Scale", "SupportTable",
           "SavedProgramError", "Stages", "UnavailableValue", "UnknownValue", "UnsupportedModel", "Zero", "chat_prompt", "instrument", "load", "patch", "render",
           "skip_layers", "steer", "support"]

check_versions()  # qgraph's private calls (qgraph/compat.py) were written for one torch and transformers
