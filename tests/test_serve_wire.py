"""The serving body (qgraph.serve.wire): a round trip keeps every tensor and the call, and every
hostile body is refused by name before any tensor is made."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from qgraph.serve.wire import Bounds, WireError, pack, parse


def _body(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


CALL = {"__metadata__": {"qgraph": json.dumps({"values": []})}}


def test_a_round_trip_keeps_the_call_and_every_tensor_bit_for_bit():
    tensors = {"input_ids": torch.randint(0, 1000, (2, 5)), "attention_mask": torch.ones(2, 5, dtype=torch.int64),
               "edit.0": torch.randn(3, 4).to(torch.bfloat16), "logits": torch.randn(2, 5, 7),
               "mask": torch.tensor([True, False]), "empty": torch.zeros(0, 3)}
    call = {"values": ["layers.*.layer_output"], "edits": {"layers.1.layer_output": {"kind": "zero", "positions": [-1]}}}
    got_call, got = parse(pack(call, tensors))
    assert got_call == call and got.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert parse(pack({}, {}))[1] == {}


def test_a_tensor_of_another_dtype_is_refused_when_packed():
    with pytest.raises(WireError, match="complex64"):
        pack({}, {"x": torch.zeros(2, dtype=torch.complex64)})


HOSTILE = {
    "short": (b"\x01\x02", "is 2 bytes"),
    "header past the body": (struct.pack("<Q", 1000) + b"{}", "header length is 1,000"),
    "header of 2**63": (struct.pack("<Q", 2**63) + b"{}", "header length is 9,223,372,036,854,775,808"),
    "not JSON": (struct.pack("<Q", 3) + b"{x}", "not JSON"),
    "not UTF-8": (struct.pack("<Q", 2) + b"\xff\xfe", "not JSON"),
    "a list": (_body([]), "not a JSON object"),  # type: ignore[arg-type]
    "nested 100,000 deep": (struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000, "not JSON"),
    "an int of 10,000 digits": (struct.pack("<Q", 10_000) + b"9" * 10_000, "not JSON"),
    "metadata nested deep": (_body({"__metadata__": {"qgraph": "[" * 100_000 + "]" * 100_000}}), "is not JSON"),
    "no metadata": (_body({}), "no __metadata__"),
    "metadata not JSON": (_body({"__metadata__": {"qgraph": "{"}}), "is not JSON"),
    "metadata a list": (_body({"__metadata__": {"qgraph": "[]"}}), "not a JSON object"),
    "another metadata key": (_body({"__metadata__": {"qgraph": "{}", "x": "1"}}), "holds only 'qgraph'"),
    "unknown dtype": (_body({**CALL, "x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
                      "field 'dtype' is not one of F32, F16, BF16, F64, I64, I32, BOOL: 'C64'"),
    "negative size": (_body({**CALL, "x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}), "shape"),
    "bool size": (_body({**CALL, "x": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4),
                  "field 'shape' is not at most 8 sizes, each an int >= 0: [True]"),
    "nine dims": (_body({**CALL, "x": {"dtype": "F32", "shape": [1] * 9, "data_offsets": [0, 4]}}, b"\0" * 4), "at most 8"),
    "extra field": (_body({**CALL, "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "code": "x"}},
                          b"\0" * 4), "not an object of exactly the fields data_offsets, dtype, shape: it holds ['code'] too"),
    "offsets reversed": (_body({**CALL, "x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4),
                         "start <= stop"),
    "bytes off": (_body({**CALL, "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
                  "8 bytes, but its offsets hold 4"),
    "overlap": (_body({**CALL, "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                       "y": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "overlap"),
    "past the data": (_body({**CALL, "x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 4),
                      "data is 4 bytes"),
    "bytes after": (_body({**CALL, "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),
                    "data is 8 bytes"),
    "2**40 elements declared": (_body({**CALL, "x": {"dtype": "F32", "shape": [2**20, 2**20], "data_offsets": [0, 4]}},
                                      b"\0" * 4), "elements"),
    "odd name": (_body({**CALL, "\n": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
                 "printable"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_body_is_refused_by_name(case):
    body, message = HOSTILE[case]
    with pytest.raises(WireError, match=message.replace("[", r"\[").replace("(", r"\(")) as raised:
        parse(body)
    assert raised.value.status == 400


def test_the_bounds_are_the_callers():
    body = pack({}, {f"t{i}": torch.zeros(1) for i in range(5)})
    with pytest.raises(WireError, match="5 tensors, more than the 4"):
        parse(body, Bounds(tensors=4))
    with pytest.raises(WireError, match="header length"):
        parse(body, Bounds(header_bytes=16))
    assert len(parse(body)[1]) == 5
