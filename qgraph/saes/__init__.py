"""Sparse autoencoders: ``SAE.load(path, layer=i)`` reads Qwen-Scope, SAELens and sparsify SAEs into
one record (``sae.py``; the formats in ``formats.py``, tiny random ones for tests in ``fixtures.py``);
``Transcoder.load(path, layer=i)`` reads circuit-tracer's and SAELens's per-layer transcoders
(``transcoder.py``, ``transcoder_formats.py``). Each loads from a local path or a Hugging Face Hub
repository id (``hub.py``), its files' sizes bounded before they are read (``bounds.py``)."""
from .sae import SAE
from .transcoder import Transcoder

__all__ = ["SAE", "Transcoder"]
