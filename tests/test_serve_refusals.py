"""What ``qgraph serve`` refuses, as an attacker or a careless client would send it: each bad request gets
its status and a JSON message naming the problem, one request's failure fails that request alone, the
server answers ``/v1/health`` through all of it, and SIGTERM ends it cleanly."""
from __future__ import annotations

import signal
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
import torch

import qgraph
from qgraph.serve.batcher import Batcher, QueueFull, TimedOut
from qgraph.serve.limits import Limits
from qgraph.serve.request import Request
from qgraph.serve.wire import pack
from tests.serving import KEY, MEDIA, start_server

AUTH = {**MEDIA, "Authorization": f"Bearer {KEY}"}


def ids_of(batch=1, seq=5, seed=0):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def post(url, body, headers=AUTH):
    return httpx.post(f"{url}/v1/run", content=body, headers=headers, timeout=60)


def refused(response, status, *words):
    assert response.status_code == status, (response.status_code, response.text)
    message = response.json()["error"]
    for word in words:
        assert word in message, message
    return message


def call(url, call, tensors=None):
    return post(url, pack(call, {"input_ids": ids_of(), **(tensors or {})}))


def test_bodies_that_do_not_parse_get_400(url):
    body = pack({"values": ["layers.0.layer_output"]}, {"input_ids": ids_of()})
    refused(post(url, body[:-7]), 400, "data")  # truncated
    refused(post(url, b"GET / HTTP/1.1 not a body"), 400, "header")
    refused(post(url, b""), 400, "0 bytes")
    refused(call(url, {"values": [], "shell": "rm -rf /"}), 400, "shell")
    assert httpx.get(f"{url}/v1/health").status_code == 200


def test_missing_keys_and_routes(url):
    body = pack({}, {"input_ids": ids_of()})
    refused(post(url, body, MEDIA), 401, "Bearer")
    refused(post(url, body, {**MEDIA, "Authorization": "Basic " + KEY}), 401)
    refused(httpx.get(f"{url}/v1/nothing"), 404, "/v1/run")
    refused(httpx.get(f"{url}/v1/run"), 405, "POST /v1/run")


def test_bodies_over_the_limit_get_413_before_they_are_read(url):
    refused(post(url, b"\0" * 200_001), 413, "--max-request-bytes")

    def chunks():  # no Content-Length: refused as it comes
        for _ in range(100):
            yield b"\0" * 10_000

    refused(post(url, chunks()), 413, "--max-request-bytes")
    refused(post(url, pack({}, {"input_ids": ids_of(4, 100)})), 413, "--max-batch-tokens")
    assert httpx.get(f"{url}/v1/health").status_code == 200


@pytest.mark.parametrize("bad, words", [
    ({"values": ["layers.9.layer_output"]}, ["layers.9.layer_output"]),
    ({"values": ["layers.*.no_such_value"]}, ["no_such_value"]),
    ({"values": [7]}, ["a value"]),
    ({"values": {"layers.1.layer_output": {"grad": "yes"}}}, ["grad"]),
    ({"edits": {"layers.1.layer_output": {"kind": "Zero", "positions": [50]}}}, ["out of range"]),
    ({"edits": {"layers.1.layer_output": {"kind": "Exec", "code": "import os"}}}, ["Exec"]),
    ({"edits": {"layers.1.layer_output": {"kind": "Zero", "code": 1}}}, ["code"]),
    ({"edits": {"layers.1.layer_output": {"kind": "Replace", "tensor": "input_ids"}}}, ["edit.0"]),
    ({"edits": {"layers.1.layer_output": {"kind": "Scale", "factor": 1e400}}}, ["factor"]),
    ({"edits": {"layers.1.layer_output": {"kind": "Add", "tensor": "edit.0.tensor"}}}, ["broadcastable"]),
    ({"edits": {"layers.0.linear_attn.states": {"kind": "Zero"}}}, ["read-only"]),
    ({"generate": {"max_new_tokens": 13}}, ["--max-new-tokens"]),
    ({"generate": {"max_new_tokens": 2, "num_beams": 4}}, ["num_beams"]),
    ({"backward": "nothing"}, ["backward"]),
    ({"backward": "input_ids"}, ["backward", '{"grad": true}']),  # values a list (the default): no gradients to return
    ({"lens": {"positions": [0], "top": 10**6}}, ["lens"]),
    ({"lens": {"positions": "every"}}, ["lens", "'positions'", '"all" or a list']),
    ({"lens": {"logits": 1}}, ["lens", "'logits'", "true or false"]),
])
def test_requests_that_cannot_run_get_422(url, bad, words):
    tensors = {"edit.0.tensor": torch.ones(3, 3)} if "Add" in str(bad) else {}
    refused(call(url, bad, tensors), 422, *words)


@pytest.mark.parametrize("settings, words", [
    ({"do_sample": True, "temperature": 0}, ["generate's temperature=0.0", "strictly positive", "do_sample=False"]),
    ({"do_sample": True, "top_k": -5}, ["generate's top_k=-5", "leave it out"]),
    ({"repetition_penalty": 0}, ["generate's repetition_penalty=0.0", "leave it out"]),
    ({"do_sample": True, "top_p": -1.0}, ["generate's top_p=-1.0", "leave it out"]),
    ({"do_sample": True, "seed": 2**70}, ["seed is 1180591620717411303424", "leave it out"]),
], ids=["temperature", "top_k", "repetition_penalty", "top_p", "seed"])
def test_generation_settings_transformers_refuses_get_422_before_anything_runs(url, settings, words):
    before = httpx.get(f"{url}/v1/health").json()
    refused(call(url, {"generate": {"max_new_tokens": 2, **settings}}), 422, *words)
    after = httpx.get(f"{url}/v1/health").json()
    assert after["forwards"] == before["forwards"] and after["requests"] == before["requests"]  # refused unqueued


def test_a_reply_over_the_limit_gets_413_before_the_forward(url):
    before = httpx.get(f"{url}/v1/health").json()["forwards"]
    body = pack({"values": ["layers.*.linear_attn.states"]}, {"input_ids": ids_of(4, 64)})  # 3 blocks x 1 MiB
    message = refused(post(url, body), 413, "--max-reply-bytes 2,000,000", "fewer values")
    assert "about 3,424,256 bytes" in message  # 3 x 4 x 64 x 4 x 16 x 16 x 4 of states, 4 x 64 x 272 x 4 of logits
    assert httpx.get(f"{url}/v1/health").json()["forwards"] == before  # refused unrun
    small = pack({"values": ["layers.*.linear_attn.states"]}, {"input_ids": ids_of(1, 64)})
    assert post(url, small).status_code == 200


def test_stray_tensors_get_422(url):
    refused(call(url, {}, {"payload": torch.zeros(3)}), 422, "payload")


def test_one_bad_request_among_batched_ones_fails_alone(url, remote, sdpa_model):
    local = qgraph.instrument(sdpa_model, values=["layers.2.layer_output"])
    ig = remote.instrument(values=["layers.2.layer_output"])
    jobs = [(ids_of(1, 5, seed), qgraph.Zero(positions=[50 if seed == 3 else -1])) for seed in range(8)]

    def send(job):
        ids, edit = job
        try:
            return ig(ids, edits={"layers.1.layer_output": edit})
        except qgraph.RemoteError as error:
            return error

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(send, jobs))
    for seed, ((ids, edit), out) in enumerate(zip(jobs, outs)):
        if seed == 3:
            assert isinstance(out, qgraph.RemoteError) and out.status == 422 and "out of range" in str(out)
            continue
        ref = local(ids, edits={"layers.1.layer_output": edit})
        assert torch.allclose(out.logits, ref.logits, atol=1e-5)
        assert torch.allclose(out["layers.2.layer_output"], ref["layers.2.layer_output"], atol=1e-5)


def test_a_function_edit_runs_on_the_server_as_locally(url, remote, sdpa_model):
    ig = remote.instrument(values=["layers.2.layer_output"])
    fine = ig(ids_of(), edits={"layers.1.layer_output": lambda x: x * 2})
    local = qgraph.instrument(sdpa_model, values=["layers.2.layer_output"])
    ref = local(ids_of(), edits={"layers.1.layer_output": lambda x: x * 2})
    assert torch.allclose(fine.logits, ref.logits, atol=1e-5)
    assert torch.allclose(fine["layers.2.layer_output"], ref["layers.2.layer_output"], atol=1e-5)
    assert not torch.allclose(fine.logits, local(ids_of()).logits)  # the edit did something
    assert httpx.get(f"{url}/v1/health").status_code == 200


# -- the batcher's queue, bounded, and what it drops ----------------------------------------------------
class _SlowRunner:
    def __init__(self):
        self.ran, self.release = [], threading.Event()

    def batchable(self, request):
        return True

    def check(self, request):
        pass

    def run(self, requests):
        self.release.wait(10)
        self.ran += requests
        return [({}, {}) for _ in requests]


def _request(seed=0):
    ids = ids_of(1, 3, seed)
    return Request([], {}, ids, torch.ones_like(ids))


def test_a_full_queue_refuses_and_a_gone_client_costs_nothing():
    runner = _SlowRunner()
    batcher = Batcher(runner, Limits(max_queue=2, timeout_s=30))
    try:
        first = batcher.submit(_request())
        time.sleep(0.2)  # the thread has taken it and waits in run
        waiting = [batcher.submit(_request(seed)) for seed in (1, 2)]
        with pytest.raises(QueueFull, match="queue is full"):
            batcher.submit(_request(3))
        assert waiting[0].cancel()  # its client went away before it ran
        runner.release.set()
        first.result(10), waiting[1].result(10)
        assert len(runner.ran) == 2 and all(r is not None for r in runner.ran)
    finally:
        runner.release.set()
        batcher.close(10)


def test_a_request_past_its_time_limit_is_dropped_unrun():
    runner = _SlowRunner()
    batcher = Batcher(runner, Limits(timeout_s=0.3))
    try:
        first = batcher.submit(_request())
        time.sleep(0.1)
        late = batcher.submit(_request(1))
        time.sleep(0.5)
        runner.release.set()
        first.result(10)
        with pytest.raises(TimedOut, match="time limit"):
            late.result(10)
        assert len(runner.ran) == 1
    finally:
        runner.release.set()
        batcher.close(10)


# -- the command ------------------------------------------------------------------------------------------
def test_no_keys_means_loopback_only(capsys):
    from qgraph.cli import main
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--api-keys" in err and "127.0.0.1" in err


@pytest.mark.slow  # a server process started and signalled (python -m pytest -m slow)
def test_sigterm_ends_the_server_cleanly(checkpoint, tmp_path):
    process, url = start_server(checkpoint, tmp_path)
    port = int(url.rsplit(":", 1)[1])
    replies: list = []
    remote = qgraph.remote(url, api_key=KEY)
    ig = remote.instrument(values=["layers.0.layer_output"])
    worker = threading.Thread(target=lambda: replies.append(_try(lambda: ig.generate(ids_of(), max_new_tokens=12))))
    worker.start()
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) in (0, -signal.SIGTERM)  # uvicorn ends on the signal once it has shut down
    worker.join(60)
    reply = replies[0]  # finished, or refused with a reason; never a hang
    assert isinstance(reply, qgraph.GenerateOutput) and reply.sequences.shape == (1, 17) or \
        isinstance(reply, (qgraph.RemoteError, httpx.HTTPError))
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def _try(function):
    try:
        return function()
    except Exception as error:  # noqa: BLE001
        return error


# -- hostile function graphs and clients that leave ---------------------------------------------------------
@pytest.mark.parametrize("target, args", [
    ("os.system", ["touch {canary}"]),
    ("builtins.exec", ["open({canary!r}, 'w').write('ran')"]),
    ("torch.ops.aten.copy_.default", [{"node": "value"}, {"node": "value"}]),
    ("torch.ops.aten.mul.Tensor", [{"node": "value"}, "open({canary!r}, 'w')"]),
])
def test_a_hostile_function_graph_gets_422_and_nothing_runs(url, tmp_path, target, args):
    canary = tmp_path / "canary"
    args = [arg.format(canary=str(canary)) if isinstance(arg, str) else arg for arg in args]
    graph = {"format": 1, "dims": ["batch", "seq", "hidden_size"], "graph": {"nodes": [
        {"name": "value", "op": "placeholder"},
        {"name": "evil", "op": "call_function", "target": target, "args": args},
        {"name": "output", "op": "output", "args": [{"node": "value"}]}]},
        "symbols": {"batch": {"min": 1, "max": 4096}, "seq": {"min": 1, "max": 65536}},
        "placeholders": [{"shape": ["batch", "seq", 64], "dtype": "float32", "device": "cpu"}], "tensors": {}}
    response = call(url, {"edits": {"layers.1.layer_output": {"kind": "function", "graph": graph}}})
    refused(response, 422, "function edit")
    assert not canary.exists()
    assert httpx.get(f"{url}/v1/health").status_code == 200


def test_a_client_that_leaves_mid_body_costs_nothing(url):
    host, port = url.removeprefix("http://").split(":")
    body = pack({"values": ["layers.0.layer_output"]}, {"input_ids": ids_of(1, 64)})
    for cut in (10, len(body) // 2):
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(f"POST /v1/run HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\nContent-Length: "
                        f"{len(body)}\r\n\r\n".encode() + body[:cut])
    before = httpx.get(f"{url}/v1/health").json()
    time.sleep(0.5)
    after = httpx.get(f"{url}/v1/health").json()
    assert after["requests"] == before["requests"] and after["waiting"] == 0


def test_a_request_moves_to_the_models_device():
    ids = ids_of()
    request = Request([], {"a": qgraph.Replace(torch.ones(3)), "b": qgraph.Scale(torch.ones(3)), "c": qgraph.Zero(),
                           "d": qgraph.Add(torch.ones(3), scale=2.0, positions=[0])},
                      ids, torch.ones_like(ids), backward=torch.ones(1, 5, 7))
    moved = request.to(torch.device("meta"))
    assert moved.input_ids.is_meta and moved.attention_mask.is_meta and moved.backward.is_meta
    assert moved.edits["a"].tensor.is_meta and moved.edits["b"].factor.is_meta and moved.edits["d"].tensor.is_meta
    assert moved.edits["d"].scale == 2.0 and moved.edits["d"].positions == [0]
    assert not request.input_ids.is_meta and not request.edits["a"].tensor.is_meta  # the request itself is kept


def test_a_client_that_leaves_while_its_request_waits_is_dropped_unrun():
    import uvicorn

    from qgraph.serve.server import create_app
    runner = _SlowRunner()
    runner.info = lambda: {"model": {}, "values": {}}
    server = uvicorn.Server(uvicorn.Config(create_app(runner, Limits(timeout_s=30)), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, url, pack({"values": []}, {"input_ids": ids_of()}), MEDIA)
            time.sleep(0.3)  # the runner holds it
            body = pack({"values": []}, {"input_ids": ids_of(seed=1)})
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                raw.sendall(f"POST /v1/run HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
                time.sleep(0.3)
                assert httpx.get(f"{url}/v1/health").json()["waiting"] == 1  # it waits behind the first
            time.sleep(0.3)  # its client has gone: the server dropped it
            runner.release.set()
            assert first.result(10).status_code == 200
        time.sleep(0.3)
        assert len(runner.ran) == 1 and torch.equal(runner.ran[0].input_ids, ids_of())
        assert httpx.get(f"{url}/v1/health").json() == {"status": "ok", "waiting": 0, "requests": 1, "forwards": 0}
    finally:
        runner.release.set()
        server.should_exit = True
        thread.join(30)
