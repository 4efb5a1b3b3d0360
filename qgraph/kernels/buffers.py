"""Memory for the big per-token state buffers: huge-page mappings and a pool that reuses them.

The all-token states of :func:`qgraph.kernels.delta_states.chunk_gated_delta_rule_with_states`
are large (256 MiB per 0.8B DeltaNet block at 256 tokens), and on CPU writing them into fresh
memory costs more than computing them. :func:`empty` allocates such buffers on anonymous mappings
advised for transparent huge pages, and takes them from the active :class:`BufferPool` (set with
:func:`reusing`, as ``Program.run`` does) when one is free.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import mmap
import os
import sys
import threading

import torch

__all__ = ["BufferPool", "HUGE_PAGE_MIN_BYTES", "empty", "reusing"]


#: State buffers of at least this many bytes on CPU are backed by transparent huge pages (Linux
#: only; ``None`` disables). All-token states are large (256 MiB per 0.8B DeltaNet
#: block at 256 tokens) and on CPU first-touching fresh 4 KiB pages costs several times the
#: arithmetic that fills them; 2 MiB pages cut that ~4x. PyTorch does the same for every
#: allocation when ``THP_MEM_ALLOC_ENABLE=1`` is set, in which case this is skipped.
HUGE_PAGE_MIN_BYTES: int | None = 32 << 20
_HUGE_PAGE = 2 << 20


class BufferPool:
    """Big CPU state buffers kept for the next forward once nobody uses them.

    On CPU, writing the states into fresh memory costs more than computing them: every page is
    faulted in (and zeroed) by the kernel on first touch, ~2.3 s for the 4.6 GB of a 0.8B forward at
    256 tokens. A program that captures states keeps their mappings here (``Program.run`` activates
    its pool with :func:`reusing`) and the next call writes into pages already faulted in, as CUDA's
    caching allocator does on the GPU. A mapping is reused only when no tensor uses it any more:
    ``torch.frombuffer`` holds a reference to the mapping for as long as any tensor (or view) uses
    its memory, so one referenced only by the pool is free. ``release()`` (or dropping the pool with
    its program) returns the memory to the system.
    """

    def __init__(self):
        self._mappings: list[mmap.mmap] = []
        self._lock = threading.Lock()  # two threads calling one program never take the same mapping

    def take(self, size: int) -> mmap.mmap | None:
        """A free mapping of ``size`` bytes (None if there is none; then the free mappings of other
        sizes are released: a new prompt length will not use them). The caller's reference makes
        it used before the lock is released."""
        with self._lock:
            for index in range(len(self._mappings)):
                if len(self._mappings[index]) == size and self._unused(index):
                    taken = self._mappings[index]
                    return taken
            self._mappings = [self._mappings[i] for i in range(len(self._mappings)) if not self._unused(i)]
            return None

    def _unused(self, index: int) -> bool:
        return sys.getrefcount(self._mappings[index]) <= 2  # the pool's list and getrefcount's argument

    def add(self, mapping: mmap.mmap) -> None:
        """Keep ``mapping`` (just handed out) for later calls."""
        with self._lock:
            self._mappings.append(mapping)

    def release(self) -> None:
        """Forget every mapping (each is unmapped once no tensor uses it)."""
        self._mappings = []

    @property
    def nbytes(self) -> int:
        """Bytes the pool keeps mapped (in use or free)."""
        return sum(len(mapping) for mapping in self._mappings)


_POOL: contextvars.ContextVar[BufferPool | None] = contextvars.ContextVar("qgraph_state_buffers", default=None)


@contextlib.contextmanager
def reusing(pool: BufferPool):
    """Big state buffers allocated in this block come from (and go back to) ``pool``."""
    token = _POOL.set(pool)
    try:
        yield
    finally:
        _POOL.reset(token)


def empty(shape, dtype, device) -> torch.Tensor:
    """``torch.empty`` for big CPU buffers, on a huge-page-advised anonymous mapping if possible,
    reused from the active :class:`BufferPool` when one is free.

    The tensor owns the mapping (it keeps the ``mmap`` object alive through its buffer export)
    and has ordinary contiguous strides and storage offset 0.
    """
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if (HUGE_PAGE_MIN_BYTES is None or nbytes < HUGE_PAGE_MIN_BYTES or torch.device(device).type != "cpu"
            or not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE")
            or os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"):
        return torch.empty(shape, dtype=dtype, device=device)
    pool = _POOL.get()
    size = nbytes + _HUGE_PAGE  # one huge page more, to start at a 2 MiB boundary so whole huge pages fit
    try:
        region = pool.take(size) if pool is not None else None
        if region is None:
            region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            region.madvise(mmap.MADV_HUGEPAGE)
            if pool is not None:
                pool.add(region)
        address = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
        offset = -address % _HUGE_PAGE
        return torch.frombuffer(region, dtype=dtype, count=numel, offset=offset).view(shape)
    except (OSError, ValueError, TypeError, RuntimeError):
        return torch.empty(shape, dtype=dtype, device=device)
