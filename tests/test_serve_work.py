"""What a key holder can make the server compute: a request's function edits are counted (saved/work.py)
at its own sizes before it is queued, and refused (413) past ``--max-edit-work`` times its forward, so the
issue's 100 chained 2048 x 2048 products cost the server the count, not 30 s of every client's time."""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest
import torch

import qgraph
from qgraph.serve.function import export_function, load_function
from qgraph.serve.limits import Limits
from qgraph.serve.request import Request, TooLarge
from qgraph.serve.wire import pack
from qgraph.serve.work import check_edit_work
from tests.serving import KEY, MEDIA

AUTH = {**MEDIA, "Authorization": f"Bearer {KEY}"}


def chained(size: int) -> dict:
    """The issue's function edit, 100 chained ``size`` x ``size`` products, as the wire carries it: exported
    at 16 (the client runs a function once to export it) and its sizes set to ``size`` after, as an
    attacker's own client would send it."""
    def fn(x):
        y = x.new_ones(16, 16)
        for _ in range(100):
            y = y @ y
        return x + y[0, 0] * 0
    data, _ = export_function(fn, torch.randn(2, 5, 64), ("batch", "seq", "hidden"), "attack")
    return json.loads(json.dumps(data).replace("[16, 16]", f"[{size}, {size}]"))


def ids_of(batch=1, seq=5):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))


def test_a_function_edit_past_its_forward_gets_413_before_it_runs(url, remote, sdpa_model):
    body = pack({"values": ["layers.2.layer_output"],
                 "edits": {"layers.1.layer_output": {"kind": "function", "graph": chained(2048)}}}, {"input_ids": ids_of()})
    health = httpx.get(f"{url}/v1/health").json()
    start = time.perf_counter()
    reply = httpx.post(f"{url}/v1/run", content=body, headers=AUTH, timeout=60)
    took = time.perf_counter() - start
    assert reply.status_code == 413, reply.text
    assert re.search(r"function edits would compute 1.7\d*e\+12 floating-point operations, more than 1 x its "
                     r"forward's", reply.json()["error"]), reply.text
    assert took < 5, took  # counted, not run (running it: about 100 s here)
    ig = remote.instrument(values=["layers.2.layer_output"])
    steer = torch.randn(sdpa_model.config.hidden_size)
    local = qgraph.instrument(sdpa_model, values=["layers.2.layer_output"])
    fine = ig(ids_of(), edits={"layers.1.layer_output": lambda x: x + steer})
    torch.testing.assert_close(fine.logits, local(ids_of(), edits={"layers.1.layer_output": lambda x: x + steer}).logits,
                               rtol=0, atol=1e-5)
    assert httpx.get(f"{url}/v1/health").json()["forwards"] == health["forwards"] + 1  # the refused one never ran


def _request(edit, pattern, batch=2, seq=7, new=None):
    ids = ids_of(batch, seq)
    generate = None if new is None else {"max_new_tokens": new}
    return Request(["layers.2.layer_output"], {pattern: edit}, ids, torch.ones_like(ids), True, generate, None, None)


def test_the_work_counts_every_slot_and_every_step():
    """The count is the edit's work at the request's sizes, times the slots its pattern names, plus each
    new token's step (its values one position long); within the limit it passes, past it it is refused."""
    hidden = 64
    weight = torch.randn(hidden, hidden)
    data, tensors = export_function(lambda x: x @ weight + 1, torch.randn(2, 5, hidden), ("batch", "seq", "hidden"), "e")
    edit = load_function(data, tensors, "e")
    prompt, step = edit.work([2, 7, hidden]), edit.work([2, 1, hidden])
    assert step < prompt < 7 * step and prompt >= 2 * 2 * 7 * hidden * hidden  # the product's multiply-adds, at least
    three = lambda pattern: ["a", "b", "c"]  # noqa: E731 (a pattern naming three slots)
    assert check_edit_work(_request(edit, "x"), three, 10**9, Limits()) == 3 * prompt
    assert check_edit_work(_request(edit, "x", new=4), three, 10**9, Limits()) == 3 * (prompt + 4 * step)
    forward = 2 * 1000 * 2 * 7
    with pytest.raises(TooLarge, match="--max-edit-work"):
        check_edit_work(_request(edit, "x"), three, 1000, Limits())
    assert check_edit_work(_request(edit, "x"), three, 1000, Limits(max_edit_work=3 * prompt / forward)) == 3 * prompt
