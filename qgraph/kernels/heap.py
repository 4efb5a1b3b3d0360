"""Keep the heap a call's values grew for the next call (glibc's ``malloc``, Linux).

A call that captures many values returns them in memory the C heap grew for them (every tensor under
32 MiB comes from ``malloc``'s heap). When you drop them, glibc gives the heap's free top back to the
system as soon as it passes its trim threshold (64 MiB at most), so the next call's values land in
fresh pages that the kernel faults in and zeroes one by one: on a 2-core CPU 0.26 s per GiB, a tenth
of a 0.8B forward that returns every standard value (566 MiB). The plain forward never pays it: its
intermediates are freed as it goes and their memory is reused at once.

After each call, :func:`keep` raises the trim threshold to the heap's size (once that passes glibc's
own largest, 64 MiB), so what the call's values grew stays mapped for the next call, as the states'
memory does (``buffers.BufferPool``) and CUDA's caching allocator does on the GPU. It costs memory:
the heap's free part stays resident after you drop the values, up to the heap's size at the end of
the largest call. :func:`release` (``ig.release_buffers()``) gives it back. A threshold set by hand
turns glibc's moving thresholds off, so both set them where glibc's own settle once a 32 MiB tensor
has been freed: mmap above 32 MiB, trim (after :func:`release`) above 64 MiB. Elsewhere than Linux
with glibc, or with ``QGRAPH_KEEP_HEAP=0``, they do nothing.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

__all__ = ["keep", "kept", "release", "size"]

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest moving mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # its largest moving trim threshold: keep() changes nothing below it


class _State:
    """glibc's calls (``sbrk``, ``mallopt``, ``malloc_trim``; None where there are none), where the
    heap starts, and the trim threshold :func:`keep` has set (0: none)."""

    def __init__(self):
        self.libc = _glibc()
        self.start: int | None = None
        self.threshold = 0
        self.lock = threading.Lock()


def _glibc():
    """glibc with the calls typed, or None (another C library or system, or ``QGRAPH_KEEP_HEAP=0``)."""
    if not sys.platform.startswith("linux") or os.environ.get("QGRAPH_KEEP_HEAP") == "0":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (glibc's own: musl has mallopt too, with other meanings)
        libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
        libc.mallopt.restype, libc.mallopt.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.restype, libc.malloc_trim.argtypes = ctypes.c_int, [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


_STATE = _State()


def size() -> int:
    """Bytes from the heap's start to its end (the program break): 0 where it is not known."""
    if _STATE.libc is None:
        return 0
    if _STATE.start is None:  # where the heap starts, read once: [heap] in /proc/self/maps
        try:
            with open("/proc/self/maps") as maps:
                line = next((line for line in maps if line.rstrip().endswith("[heap]")), None)
        except OSError:
            return 0
        if line is None:
            return 0
        _STATE.start = int(line.split("-", 1)[0], 16)
    return (_STATE.libc.sbrk(0) or 0) - _STATE.start


def kept() -> int:
    """The trim threshold :func:`keep` has set (bytes of free heap glibc keeps); 0 when it has set none."""
    return _STATE.threshold


def _thresholds(trim: int) -> None:
    _STATE.libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    _STATE.libc.mallopt(M_TRIM_THRESHOLD, min(trim, 2**31 - 1))  # mallopt takes an int


def keep() -> None:
    """After a call: let glibc keep as much free heap as the heap now holds, when that is more than it
    keeps by itself (64 MiB) and more than an earlier call asked (see the module's docstring)."""
    now = size()
    if now <= max(_STATE.threshold, TRIM_THRESHOLD):
        return
    with _STATE.lock:
        if now > _STATE.threshold:
            _thresholds(now)
            _STATE.threshold = now


def release() -> None:
    """Give the heap's free memory back to the system; glibc's trim threshold goes back to 64 MiB."""
    if _STATE.libc is None:
        return
    with _STATE.lock:
        _thresholds(TRIM_THRESHOLD)
        _STATE.threshold = 0
        _STATE.libc.malloc_trim(0)
