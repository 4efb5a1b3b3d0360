"""Export: a Hugging Face model's forward as one ``torch.export`` program with dynamic batch and
sequence dims, port markers around every module and the delta-rule kernels as custom ops.

``trace`` exports (once per model and kind of program), ``repeat`` builds the full program from
one traced block per kind, ``disk_cache`` keeps programs across processes, ``fingerprint`` says
what a program was specialised on.
"""
from .trace import TEXT_INPUTS, ExportedModel, export_model, has_vision

__all__ = ["TEXT_INPUTS", "ExportedModel", "export_model", "has_vision"]
