"""The body of a serving request and reply: one safetensors file whose ``__metadata__["qgraph"]`` is
a JSON object (the call: names, edits, settings), the tensors beside it (ids, masks, edit tensors,
logits, values). Nothing in a body is code; ``docs/serving.md`` is the format for other clients.

``parse`` reads an untrusted body as safetensors does, with bounds first: the header's length is
checked against the body and a limit before it is read, every tensor's dtype is on a positive list,
its shape and its bytes are checked against its offsets, the offsets tile the data exactly (no gap,
no overlap, nothing past the end), and the count of tensors and elements is bounded, all before any
tensor is made. Every refusal is a ``WireError`` naming the field.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch

from ..errors import InvalidArgument
from ..saved.fields import Fields, integer, list_of, one_of, shown, text

# safetensors' dtype names -> the torch dtype and its bytes per element: the dtypes a call may carry
DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
          "F64": (torch.float64, 8), "I64": (torch.int64, 8), "I32": (torch.int32, 4), "BOOL": (torch.bool, 1)}
_NAMES = {dtype: name for name, (dtype, _) in DTYPES.items()}
_TENSOR_NAME = text(200, printable=True)
_SIZE = integer(0, 2**62 - 1)  # a size or an offset a header may give
_SHAPE = list_of(_SIZE, high=8)


class WireError(InvalidArgument):
    """A body that is not a qgraph serving body (the server answers 400 with this message)."""

    status = 400


@dataclass(frozen=True)
class Bounds:
    """What one body may hold."""

    header_bytes: int = 1 << 20  # the safetensors header (names, shapes, offsets, the JSON call)
    tensors: int = 256
    elements: int = 1 << 28  # all tensors together


def pack(call: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    """A body holding ``call`` (a JSON-able dict) and ``tensors`` (contiguous copies, on the CPU)."""
    from safetensors.torch import save

    for name, tensor in tensors.items():
        if tensor.dtype not in _NAMES:
            raise WireError(f"tensor {name!r} is {tensor.dtype}; a body carries {', '.join(map(str, _NAMES))}")
    plain = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    return save(plain, metadata={"qgraph": json.dumps(call, separators=(",", ":"))})


def parse(body: bytes, bounds: Bounds = Bounds()) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(call, tensors)`` of an untrusted body, or ``WireError`` naming what is wrong with it."""
    if len(body) < 8:
        raise WireError(f"the body is {len(body)} bytes: a qgraph body is a safetensors file (8 bytes of header "
                        f"length, then the header)")
    (length,) = struct.unpack("<Q", body[:8])
    if length > bounds.header_bytes or length > len(body) - 8:
        raise WireError(f"the body's header length is {length:,} bytes, more than the "
                        f"{min(bounds.header_bytes, len(body) - 8):,} it may have (the body is truncated, or not "
                        f"safetensors)")
    try:
        header = json.loads(body[8:8 + length].decode("utf-8"))
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, an int past Python's digits, too deep
        raise WireError(f"the body's header is not JSON ({str(error)[:200]})") from None
    if not isinstance(header, dict):
        raise WireError("the body's header is not a JSON object")
    call = _call(header.pop("__metadata__", None))
    data = len(body) - 8 - length
    entries = sorted(((_entry(name, entry), name) for name, entry in header.items()), key=lambda item: item[0][0])
    if len(entries) > bounds.tensors:
        raise WireError(f"the body holds {len(entries)} tensors, more than the {bounds.tensors} a call may carry")
    if sum(math.prod(shape) for (_, _, _, shape), _ in entries) > bounds.elements:
        raise WireError(f"the body's tensors hold more than the {bounds.elements:,} elements a call may carry")
    end = 0
    for (start, stop, dtype, shape), name in entries:
        if start != end:
            raise WireError(f"tensor {name!r} starts at byte {start:,} of the data, not at {end:,} (a gap or an "
                            f"overlap)")
        if stop - start != math.prod(shape) * DTYPES[dtype][1]:
            raise WireError(f"tensor {name!r} is {dtype} {shape}, {math.prod(shape) * DTYPES[dtype][1]:,} bytes, "
                            f"but its offsets hold {stop - start:,}")
        end = stop
    if end != data:
        raise WireError(f"the body's data is {data:,} bytes but its tensors hold {end:,} (truncated, or bytes "
                        f"after them)")
    from safetensors.torch import load
    return call, load(body)


def _call(metadata) -> dict:
    if not isinstance(metadata, dict) or not isinstance(metadata.get("qgraph"), str):
        raise WireError('the body\'s header has no __metadata__ {"qgraph": "<the call as JSON>"}')
    if set(metadata) != {"qgraph"}:
        raise WireError(f"the body's __metadata__ holds {sorted(set(metadata) - {'qgraph'})}; it holds only 'qgraph'")
    try:
        call = json.loads(metadata["qgraph"])
    except (ValueError, RecursionError) as error:
        raise WireError(f'__metadata__["qgraph"] is not JSON ({str(error)[:200]})') from None
    if not isinstance(call, dict):
        raise WireError('__metadata__["qgraph"] is not a JSON object')
    return call


def _entry(name: str, entry) -> tuple[int, int, str, list[int]]:
    if not _TENSOR_NAME(name):
        raise WireError(f"a tensor's name {shown(name)} is not 1 to 200 printable characters")
    fields = Fields(entry, f"tensor {name!r}", WireError, keys=("dtype", "shape", "data_offsets"), exact=True)
    dtype = fields.get("dtype", one_of(DTYPES), f"one of {', '.join(DTYPES)}")
    shape = fields.get("shape", _SHAPE, "at most 8 sizes, each an int >= 0")
    start, stop = fields.get("data_offsets", lambda v: list_of(_SIZE, 2, 2)(v) and v[0] <= v[1],
                             "[start, stop], ints, start <= stop")
    return start, stop, dtype, shape
