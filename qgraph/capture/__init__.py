"""Dataset-scale capture: values over a whole corpus, on disk as sharded safetensors.

    run = qgraph.capture(model, tokenizer, "corpus.jsonl", values=["layers.*.layer_output"], out="acts/",
                         context=1024, batch_size=8, dtype=torch.bfloat16, max_tokens=10_000_000)
    cap = load_capture("acts/")          # a torch Dataset over the rows

``run`` does the work (``run.py``), ``data`` packs the dataset into rows, ``writer`` writes shards on
a thread, ``manifest`` records and checks what a dir holds, ``integrity`` checks the shards' bytes and
the manifest's layout (``CaptureCorrupt``), ``read`` reads a capture back, ``cli`` is ``qgraph capture``
(``qgraph.distributed.world`` splits rows by rank under torchrun).
"""
from .integrity import CaptureCorrupt
from .manifest import CaptureMismatch
from .read import Capture, load_capture
from .run import CaptureRun, capture

__all__ = ["Capture", "CaptureCorrupt", "CaptureMismatch", "CaptureRun", "capture", "load_capture"]
