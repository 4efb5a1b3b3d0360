"""Dataset-scale capture: values over a whole corpus, on disk as sharded safetensors.

    run = qgraph.capture(model, tokenizer, "corpus.jsonl", values=["layers.*.layer_output"], out="acts/",
                         context=1024, batch_size=8, dtype=torch.bfloat16, max_tokens=10_000_000)
    cap = load_capture("acts/")          # a torch Dataset over the rows

``run`` does the work (``run.py``), ``data`` packs the dataset into rows, ``writer`` writes shards on
a thread, ``manifest`` records and checks what a dir holds, ``integrity`` checks the shards' bytes and
the manifest's layout (``CaptureCorrupt``), ``read`` reads a capture back, ``cli`` is ``qgraph capture``
(``qgraph.distributed.world`` splits rows by rank under torchrun).
"""
__all__ = ["Capture", "CaptureCorrupt", "CaptureMismatch", "CaptureRun", "capture", "load_capture"]

# each name's submodule, imported on first use: ``qgraph capture --help`` imports cli.py (and so this
# package) without torch
_NAMES = {"CaptureCorrupt": "integrity", "CaptureMismatch": "manifest", "Capture": "read", "load_capture": "read",
          "CaptureRun": "run", "capture": "run"}


def __getattr__(name: str):
    """A public name, imported from its submodule on first use."""
    if name in _NAMES:
        from importlib import import_module
        value = getattr(import_module(f"{__name__}.{_NAMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
