"""What an attribution graph's forward saves for its backwards, and what targets in flight hold: the
counts ``attribute`` bounds its batches with and ``estimate`` adds up; and the process's resident
memory, which ``estimate`` reads around its own export, build and forward."""
from __future__ import annotations

import os
import sys

import torch
from ..errors import InternalError

# a vmapped backward's working memory, in units of what one block keeps for one target (fitted at 16 and
# 128 tokens on the 0.8B shape)
TRANSIENT = 1.5


def in_flight(targets: int, blocks: int, seq: int, width: int, saved: int) -> float:
    """Bytes ``targets`` in the vmapped backward at once hold: their directions and gradients at every
    block's MLP output and the embeddings, and the backward's working memory (``TRANSIENT`` times what
    one block of the forward keeps, ``saved`` bytes for all)."""
    return 2 * targets * (blocks + 1) * seq * width * 4 + TRANSIENT * targets * saved / max(1, blocks)


class SavedBytes:
    """Counts the bytes of the distinct storages autograd saves (not those ``hold`` names); keeps them
    (``keep=True``: the real run) or none (the estimate's forward, never run backward: it also reads the
    resident memory at each, the forward's high-water mark as near as it can be read without a reset)."""

    def __init__(self, keep: bool = False):
        self.bytes, self.keep = 0, keep
        self.seen: set[tuple[int, int]] = set()  # the storages counted, by (address, bytes)
        self.built = 0  # resident() once the program is built (replacement_run sets it), before the forward
        self.high = 0  # the highest resident() read as the forward saved a tensor (the estimate's forward only)

    def hold(self, model, transcoders) -> None:
        held = [*model.parameters(), *model.buffers()]
        held += transcoders.parameters()  # a circuits.transcoders.TranscoderSet
        storage_bytes(held, self.seen)

    def pack(self, tensor: torch.Tensor):
        self.bytes += storage_bytes([tensor], self.seen)
        if not self.keep:
            self.high = max(self.high, resident())
        return tensor if self.keep else None

    def unpack(self, packed):
        if not self.keep:
            raise InternalError("qgraph.circuits.estimate's forward keeps nothing for a backward")
        return packed


def storage_bytes(tensors, seen: set[tuple[int, int]]) -> int:
    """Bytes of the storages of ``tensors`` not in ``seen`` (each added to it: a storage counts once)."""
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen and storage.nbytes():
            seen.add(key)
            total += storage.nbytes()
    return total


def resident() -> int:
    """The process's resident memory now, in bytes (Linux: ``/proc/self/statm``); elsewhere its peak so far
    (``getrusage``: then what ``estimate`` reads as a rise is a lower bound), 0 where neither is known."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
