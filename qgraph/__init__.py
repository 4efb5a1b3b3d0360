"""qgraph: read and edit what happens inside Qwen3.5 / Qwen3.6 models, from exported graphs.

    ig = qgraph.instrument(model, values=["layers.*.layer_output"])
    out = ig(**tokenizer(texts, return_tensors="pt", padding=True))
    out.logits, out["layers.3.layer_output"]

``import qgraph`` imports nothing heavy (not even torch): each public name below is imported from
its submodule when it is first used (PEP 562), and that first use checks the installed torch and
transformers (``compat.check_versions``). The custom ops register when ``qgraph.kernels`` is
imported, which every module that builds, runs or loads a program does.
"""
import sys
from types import ModuleType

# public name -> the submodule (below qgraph) that defines it
_PUBLIC = {
    "Add": "edits", "Edit": "edits", "Read": "edits", "Replace": "edits", "Scale": "edits", "Zero": "edits",
    "capture": "capture", "load_capture": "capture",
    # the errors (qgraph/errors.py): every one a QgraphError; their first use checks no versions
    "QgraphError": "errors", "InternalError": "errors", "InvalidArgument": "errors", "InvalidType": "errors",
    "OutOfRange": "errors", "NotSupported": "errors", "MissingFile": "errors", "InvalidState": "errors",
    "CaptureCorrupt": "errors", "CaptureMismatch": "errors", "EditError": "errors", "NoVisionEncoder": "errors",
    "NotCaptured": "errors", "UnavailableValue": "errors", "UnknownValue": "errors", "UsageError": "errors",
    "WeightsMismatch": "errors",
    "GraphvizNotFound": "render",  # a QgraphError and graphviz's ExecutableNotFound (render/dot.py)
    "UnsupportedModel": "errors", "SavedProgramError": "errors",
    "GenerateOutput": "generate", "chat_prompt": "generate",
    "Instrument": "interface", "InstrumentedModel": "instrument", "Output": "instrument", "instrument": "instrument",
    "attribution_patch": "recipes", "expert_neurons": "recipes", "patch": "recipes", "skip_layers": "recipes",
    "steer": "recipes",
    "SAE": "saes", "Transcoder": "saes", "CrossLayerTranscoder": "saes.clt",
    "AttributionGraph": "circuits", "attribution_graph": "circuits",
    "LoadedProgram": "saved", "load": "saved",
    "remote": "serve.client", "RemoteError": "serve.client",
    "Stages": "distributed",
    "register_family": "families",
    "render": "render",
    "Figure": "figure", "explore": "explore",  # pictures: out.plot, logit_lens(...).plot(), explore
    "SupportTable": "values.support", "support": "values.support",
    "check_versions": "compat",
}

__all__ = ["Instrument", "Add", "attribution_patch", "capture", "CaptureCorrupt", "CaptureMismatch", "load_capture",
           "Edit", "EditError", "expert_neurons", "GenerateOutput", "InstrumentedModel", "LoadedProgram", "Output",
           "Read", "Replace", "SAE", "Scale", "SupportTable", "SavedProgramError", "Stages", "UnavailableValue",
           "UnknownValue",
           "UnsupportedModel", "Zero", "chat_prompt", "instrument", "load", "patch", "render", "skip_layers", "steer",
           "support", "Transcoder", "CrossLayerTranscoder", "AttributionGraph", "attribution_graph", "QgraphError",
           "InternalError", "InvalidArgument", "InvalidType", "OutOfRange", "NotSupported", "MissingFile",
           "InvalidState", "NotCaptured", "NoVisionEncoder", "WeightsMismatch", "GraphvizNotFound", "UsageError",
           "register_family", "Figure", "explore", "remote", "RemoteError"]

_checked = False


def _check_versions() -> None:
    """``compat.check_versions`` once, at the first use of a public name: qgraph's private calls
    (qgraph/compat/) were written for a range of torch and transformers releases."""
    global _checked
    if not _checked:
        from .compat import check_versions  # lazy: qgraph.compat imports this module's package at import time (a cycle)
        check_versions()
        _checked = True


def __getattr__(name: str):
    """A public name (imported from its submodule on first use), ``__version__``, or a submodule."""
    if name in _PUBLIC:
        if _PUBLIC[name] != "errors":  # an error class needs no torch: `except qgraph.QgraphError` stays cheap
            _check_versions()
        from importlib import import_module
        value = getattr(import_module(f"{__name__}.{_PUBLIC[name]}"), name)
        globals()[name] = value  # later uses skip this function
        return value
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version
        try:
            value = version("qgraph")
        except PackageNotFoundError:
            value = "unknown (not installed)"
        globals()[name] = value
        return value
    if not name.startswith("__"):  # qgraph.edits, qgraph.kernels, ...: imported on first use
        from importlib import import_module
        try:
            return import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as missing:
            if missing.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | {"__version__"})


class _Package(ModuleType):
    """``qgraph`` itself. Importing the submodule ``qgraph.instrument`` (or ``.capture``, ``.render``)
    would bind the module over the function of the same name; the function is the public name, so
    such a submodule is left to ``sys.modules`` and the name to ``__getattr__``."""

    def __setattr__(self, name, value):
        if (isinstance(value, ModuleType) and _PUBLIC.get(name) == name
                and value.__name__ == f"{__name__}.{name}"):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
