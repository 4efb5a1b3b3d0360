"""A served reply equals what the request alone gets, whatever the server batches it with. Every kind of
request (plain, values, each edit kind, an edit that reads the forward, relative steering, a function edit, a given DeltaNet state or conv context, generate,
the lens, a backward) is sent together with a longer request of its program while the server's runner is
held, so the batcher takes them in one go; each reply is compared with the same request sent alone, and a
continuation from a given state also with the plain HF forward over the whole prompt."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

import qgraph
from qgraph.serve.edits import encode
from qgraph.serve.limits import Limits
from qgraph.serve.run import Runner
from qgraph.serve.wire import pack, parse
from conftest import hooked_blocks
from tests.serving import MEDIA, serve_in_process

DELTANET = [f"layers.{i}.linear_attn" for i in range(3)]  # the tiny model's blocks 0-2 (3 is attention)
CARRIED = [f"{b}.{v}" for b in DELTANET for v in ("state_output", "conv_state_output")]


class Held:
    """The server's runner, whose forwards wait while ``gate`` is shut: requests sent meanwhile queue, and
    the batcher takes those of one program together (``taken`` records what each run got)."""

    def __init__(self, runner):
        self.runner, self.taken = runner, []
        self.gate, self.holding = threading.Event(), threading.Event()
        self.gate.set()

    def __getattr__(self, name):  # info, check, forwards: the runner's
        return getattr(self.runner, name)

    def run(self, requests):
        if not self.gate.is_set():
            self.holding.set()
            self.gate.wait(120)
        self.taken.append(requests)
        return self.runner.run(requests)


@pytest.fixture(scope="module")
def served(sdpa_model):
    limits = Limits(timeout_s=300)
    held = Held(Runner(sdpa_model, limits=limits))
    with serve_in_process(held, limits) as url:
        yield held, url, held.info()["values"]


def ids_of(rows, length, seed):
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def body(catalogue, ids, values=(), edits=None, **call):
    """A request as the client sends it (a function edit exported over the value's layout)."""
    tensors, specs = {"input_ids": ids}, {}
    for index, (name, edit) in enumerate((edits or {}).items()):
        specs[name], held = encode(name, edit, f"edit.{index}", catalogue[name])
        tensors.update(held)
    for name, tensor in call.pop("tensors", {}).items():
        tensors[name] = tensor
    return pack({"values": values if isinstance(values, dict) else list(values), "edits": specs, **call}, tensors)


def send(url, content):
    response = httpx.post(f"{url}/v1/run", content=content, headers=MEDIA, timeout=300)
    assert response.status_code == 200, response.text
    return parse(response.content)


def together(held, url, bodies):
    """The replies of ``bodies`` sent at once while the runner is held (behind a request of another program),
    so the batcher finds them all waiting."""
    held.gate.clear()
    held.holding.clear()
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        blocker = pool.submit(send, url, pack({"values": ["layers.0.layer_input"]}, {"input_ids": ids_of(1, 3, 0)}))
        assert held.holding.wait(60), "the runner never got the blocking request"
        held.taken.clear()
        replies = [pool.submit(send, url, content) for content in bodies]
        for _ in range(3000):
            if httpx.get(f"{url}/v1/health").json()["waiting"] == len(bodies):
                break
            time.sleep(0.01)
        else:
            held.gate.set()
            raise AssertionError("the requests did not all queue")
        held.gate.set()
        blocker.result()
        return [reply.result() for reply in replies]


def differences(a, b, tol=1e-5) -> list[str]:
    """What differs between two replies ``(call, tensors)``: nothing, or each tensor that differs."""
    if set(a[1]) != set(b[1]) or a[0] != b[0]:
        return [f"{a[0]} {sorted(a[1])} != {b[0]} {sorted(b[1])}"]
    return [f"{name} by {(a[1][name].double() - b[1][name].double()).abs().max():.2e}" for name in a[1]
            if a[1][name].shape != b[1][name].shape or a[1][name].dtype != b[1][name].dtype
            or not torch.allclose(a[1][name].double(), b[1][name].double(), atol=tol, rtol=tol)]


def state_of(url, catalogue, ids):
    """The DeltaNet blocks' state and conv context after ``ids``: edits that continue from there."""
    _, got = send(url, body(catalogue, ids, CARRIED))
    return {**{f"{b}.state_input": qgraph.Replace(got[f"value.{b}.state_output"]) for b in DELTANET},
            **{f"{b}.conv_state_input": qgraph.Replace(got[f"value.{b}.conv_state_output"]) for b in DELTANET}}


def test_every_kind_of_request_batched_with_a_longer_one_equals_it_alone(served, sdpa_model):
    held, url, catalogue = served
    whole, other = ids_of(1, 9, 2), ids_of(1, 2, 3)
    first, continued = whole[:, :5], whole[:, 5:]  # the request continues `first` by 4 tokens
    longer = ids_of(1, 10, 4)  # its partner, of its program, is longer: the server pads the request
    gen = torch.Generator().manual_seed(5)
    state = torch.randn(1, *catalogue["layers.0.linear_attn.state_input"]["shape"][1:], generator=gen)
    conv = torch.randn(1, *catalogue["layers.1.linear_attn.conv_state_input"]["shape"][1:], generator=gen)
    carried = state_of(url, catalogue, first)
    # (case, the request, its longer partner of the same program: same values, edit names and logits)
    cases = {
        "plain": lambda ids: body(catalogue, ids),
        "values": lambda ids: body(catalogue, ids, ["layers.*.layer_output", "layers.0.linear_attn.states",
                                                    "layers.0.linear_attn.state_output", "next_token_probs",
                                                    "layers.1.linear_attn.conv_state_output",
                                                    "layers.1.linear_attn.effective_attention",
                                                    "layers.3.self_attn.attention_probabilities"], logits=False),
        "Zero": lambda ids: body(catalogue, ids, ["layers.2.layer_output"],
                                 {"layers.1.layer_output": qgraph.Zero(positions=[-1])}),
        "Add": lambda ids: body(catalogue, ids, edits={"layers.0.layer_output": qgraph.Add(
            torch.full((64,), 0.3), scale=2.5, positions=[0, -2])}),
        "Scale": lambda ids: body(catalogue, ids, ["layers.1.mlp.mlp_neurons"],
                                  {"layers.1.mlp.mlp_neurons": qgraph.Scale(0.0, neurons=[1, 5])}),
        "Replace": lambda ids: body(catalogue, ids, edits={"layers.2.layer_mid": qgraph.Replace(torch.ones(64),
                                                                                                batch=[0])}),
        "pattern": lambda ids: body(catalogue, ids, edits={"layers.3.self_attn.attention_probabilities":
                                                           qgraph.Scale(0.5, heads=[1])}),
        "a read": lambda ids: body(catalogue, ids, ["layers.3.layer_output"], {"layers.3.layer_output": qgraph.Add(
            qgraph.Read("layers.1.layer_output"), scale=0.5, positions=[0, -1])}),
        "relative": lambda ids: body(catalogue, ids, edits={"layers.2.layer_output": qgraph.Add(
            torch.full((64,), 0.3), scale=2.0, relative=True)}),
        "function": lambda ids: body(catalogue, ids, edits={"layers.2.layer_output":
                                                            lambda x: x * 2 - x.mean(1, keepdim=True)}),
        "a state added": lambda ids: body(catalogue, ids, ["layers.1.layer_output"],
                                          {"layers.0.linear_attn.state_input": qgraph.Add(state)}),
        "a conv context": lambda ids: body(catalogue, ids, ["layers.1.layer_output"],
                                           {"layers.1.linear_attn.conv_state_input": qgraph.Replace(conv)}),
        "generate": lambda ids: body(catalogue, ids, ["layers.1.layer_output"], generate={"max_new_tokens": 3}),
        "lens": lambda ids: body(catalogue, ids, lens={"positions": [-1], "top": 3}),
        "backward": lambda ids: body(catalogue, ids, {"layers.1.layer_output": {"grad": True}}, backward="d",
                                     tensors={"d": torch.ones(1, ids.shape[1], 272)}),
    }
    requests = {case: ((make(other), other), (make(longer), longer)) for case, make in cases.items()}
    reads, theirs = ["layers.2.layer_output"], state_of(url, catalogue, other)  # the partner continues `other`
    requests["continued"] = ((body(catalogue, continued, reads, carried), continued),
                             (body(catalogue, longer, reads, theirs), longer))
    again = ids_of(1, 4, 6)  # a continuation of the request's length: the two share a forward, unpadded
    requests["continued too"] = ((body(catalogue, again, reads, state_of(url, catalogue, ids_of(1, 7, 7))), again),
                                 (body(catalogue, longer.flip(1), reads, theirs), longer.flip(1)))
    order = [content for pair in requests.values() for content, _ in pair]
    replies = dict(zip(order, together(held, url, order)))
    taken = [{tuple(request.input_ids.flatten().tolist()) for request in run} for run in held.taken]
    wrong, alone = {}, {}
    for case, pair in requests.items():
        if case not in ("generate", "lens", "backward"):  # those run alone; the rest were taken together
            assert any(all(tuple(ids.flatten().tolist()) in run for _, ids in pair) for run in taken), case
        for which, (content, _) in zip(("request", "partner"), pair):
            alone[content] = send(url, content)
            if differences(replies[content], alone[content]):
                wrong[f"{case} ({which})"] = differences(replies[content], alone[content])
    assert not wrong, wrong
    # a continuation from a given state is the prompt run whole (the DeltaNet blocks); read by a forward hook
    # (output_hidden_states would leave transformers' capturing hooks on the session's model)
    _, seen = hooked_blocks(sdpa_model, whole, {2: lambda out: out[0] if isinstance(out, tuple) else out})
    hidden = seen[2][:, 5:]
    for reply in (replies, alone):
        got = reply[requests["continued"][0][0]][1]["value.layers.2.layer_output"]
        assert torch.allclose(got, hidden, atol=1e-5), (got - hidden).abs().max()
