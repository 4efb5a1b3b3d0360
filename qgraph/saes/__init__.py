"""Sparse autoencoders: ``SAE.load(path, layer=i)`` reads Qwen-Scope, SAELens and sparsify SAEs into
one record (``sae.py``; the formats in ``formats.py``, tiny random ones for tests in ``fixtures.py``)."""
from .sae import SAE

__all__ = ["SAE"]
