"""How large a dictionary's files may be, checked before a byte of one is read: one source of truth for
the local readers (``formats``, ``transcoder_formats``, ``clt_formats``) and the Hub's downloads (``hub``:
the Hub's sizes before a download, the file's size on disk after it).

A dictionary's files are untrusted data, read whole. Settings (``cfg.json``, ``config.yaml``) are parsed
into Python objects, so they are held to what a real one needs: a few KiB (a circuit-tracer set's
``config.yaml`` lists a file per layer). Weights (safetensors, Qwen-Scope's ``.pt``) are read into
memory: a Qwen-Scope SAE of a 5120-wide model with 128K features is 5 GiB of float32, a Gemma Scope 2
cross-layer block's ``w_dec [262144, 26, 1152]`` 31 GiB; the bound refuses a file no dictionary needs
before it fills a disk or the memory. Each is a module constant: raise it to load a larger one.
"""
from __future__ import annotations

from pathlib import Path, PurePath

from ..errors import InvalidArgument

SETTINGS_BYTES = 1 << 20  # a .json or .yaml file
WEIGHTS_BYTES = 64 << 30  # any other file: a .safetensors or .pt of tensors
SETTINGS = (".json", ".yaml", ".yml")


def bound(name: str | PurePath) -> int:
    """The bytes the file named ``name`` may hold: ``SETTINGS_BYTES`` for settings, ``WEIGHTS_BYTES`` else."""
    return SETTINGS_BYTES if PurePath(name).suffix in SETTINGS else WEIGHTS_BYTES


def check(file: str | PurePath, size: int | None = None) -> None:
    """Refuse ``file`` (an InvalidArgument naming it, its size and the bound) where its size is past its
    bound: ``size`` where the caller knows it (the Hub's, before a download), else its size on disk."""
    size = Path(file).stat().st_size if size is None else size
    if size > bound(file):
        settings = PurePath(file).suffix in SETTINGS
        kind, name = ("settings", "SETTINGS_BYTES") if settings else ("weights", "WEIGHTS_BYTES")
        raise InvalidArgument(f"{file}: {size:,} bytes, past the {bound(file):,} qgraph reads of a dictionary's {kind} "
                              f"file (qgraph.saes.bounds.{name}): refused unread; raise the bound to load it")
