"""The all-token states kernel in C (``states.c``), compiled at first use and called through ctypes.

Writing every token's DeltaNet state is memory-bound: 256 MiB per 0.8B block at 256 tokens. In
torch the states take a batched matmul and an in-place pass over that memory (see
:func:`qgraph.kernels.delta_states._write_all_states`); ``states.c`` runs the per-token
recurrence with the state in cache and streams each state to memory once, which on CPU is about
2x faster for the whole kernel. It is used for CPU float32 / bfloat16 states when no gradient is
wanted; anything else, or a machine without a C compiler, keeps the torch path (same values to
float32 rounding). ``QGRAPH_NATIVE=0`` turns it off.

The library is built once per process with ``$CC`` (default ``cc``) into a temporary directory
(about 0.2 s here), so it always matches this machine and this source; nothing is cached on disk.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["enabled", "write_chunk_states"]

_SOURCE = Path(__file__).with_name("states.c")
_LOCK = threading.Lock()


def enabled() -> bool:
    """Whether the C kernel is used (compiled on this call if it was not yet)."""
    return _library() is not None


@functools.cache
def _compiled() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        warnings.warn("qgraph: no C compiler ($CC or cc) found; all-token DeltaNet states use the "
                      "slower torch path (same values)", stacklevel=3)
        return None
    with tempfile.TemporaryDirectory(prefix="qgraph-native-", ignore_cleanup_errors=True) as folder:
        library = Path(folder) / "states.so"
        command = [compiler, "-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", str(_SOURCE), "-o",
                   str(library)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            warnings.warn(f"qgraph: compiling {_SOURCE.name} failed ({result.stderr.strip()[:300]}); "
                          "all-token DeltaNet states use the slower torch path (same values)", stacklevel=3)
            return None
        loaded = ctypes.CDLL(str(library))  # stays mapped after the folder is removed
    function = loaded.qgraph_chunk_states
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 9 + [ctypes.c_int]
    return loaded


def _library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it is turned off or cannot be built."""
    if os.environ.get("QGRAPH_NATIVE", "1") == "0":
        return None
    with _LOCK:  # two threads never compile twice
        return _compiled()


def write_chunk_states(out: torch.Tensor, state0: torch.Tensor, key: torch.Tensor,
                       new_values: torch.Tensor, cum: torch.Tensor) -> bool:
    """Write the state after every token of one chunk into ``out``; False if this kernel cannot.

    ``out`` ``[b, length, h, dk, dv]`` (float32 or bfloat16, each ``[dk, dv]`` contiguous) is the
    chunk's slice of the states buffer; ``state0`` ``[b, h, dk, dv]`` the state entering the chunk;
    ``key`` ``[b, h, chunk, dk]`` the normalised keys, ``new_values`` ``[b, h, chunk, dv]`` the
    corrected values and ``cum`` ``[b, h, chunk]`` the in-chunk cumulative log decay (float32, as
    :func:`qgraph.kernels.delta_states._write_all_states` receives them). No gradient flows.
    """
    batch, length, heads, k_dim, v_dim = out.shape
    if out.device.type != "cpu" or out.dtype not in (torch.float32, torch.bfloat16):
        return False
    library = _library()
    if library is None or out.stride(-1) != 1 or out.stride(-2) != v_dim:
        return False
    # Per-token decay exp(c_t - c_{t-1}) (c_{-1} = 0): the recurrence's form of the chunk's decays.
    cum = cum[..., :length]
    decay = torch.cat([cum[..., :1], cum[..., 1:] - cum[..., :-1]], dim=-1).exp()
    inputs = [x.to(torch.float32).contiguous() for x in (key[:, :, :length], new_values[:, :, :length], decay)]
    state = state0.to(torch.float32, copy=True).contiguous()  # the kernel updates it in place
    library.qgraph_chunk_states(
        state.data_ptr(), *(x.data_ptr() for x in inputs), out.data_ptr(), 0, batch * heads, heads, length,
        k_dim, v_dim, out.stride(0), out.stride(1), out.stride(2), int(out.dtype == torch.bfloat16))
    return True
