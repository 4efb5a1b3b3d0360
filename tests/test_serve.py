"""``qgraph serve`` as a lab runs it: a real server in a subprocess on 127.0.0.1, driven by the client
(``qgraph.remote``) and by a plain HTTP client, its replies equal to local ``qgraph.instrument`` on the
same checkpoint; every bad request gets its status and message and the server stays up; SIGTERM ends it."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

import qgraph
from qgraph.serve.wire import pack, parse

from tests.serving import KEY, MEDIA

@pytest.fixture(scope="module")
def local(sdpa_model):
    return qgraph.instrument(sdpa_model, values=["layers.*.layer_output", "layers.1.mlp.mlp_neurons"])


def prompts(batch=2, seq=6, seed=0, pad=0):
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if pad:
        mask[-1, :pad] = 0
    return ids, mask


def close(a, b, tol=1e-5):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), (a - b).abs().max()


# -- the routes and the keys -------------------------------------------------------------------------------
def test_health_takes_no_key_and_info_takes_one(url, remote, checkpoint):
    assert httpx.get(f"{url}/v1/health").json()["status"] == "ok"
    missing = httpx.get(f"{url}/v1/info")
    assert missing.status_code == 401 and "Authorization: Bearer" in missing.json()["error"]
    wrong = httpx.get(f"{url}/v1/info", headers={"Authorization": "Bearer researcher-key-7f3b"})
    assert wrong.status_code == 401 and "not one of" in wrong.json()["error"]
    other = httpx.get(f"{url}/v1/info", headers={"Authorization": "Bearer other-key"})
    assert other.status_code == 200
    info = remote.info()
    assert info["model"]["model_type"] == "qwen3_5_text" and info["model"]["blocks"] == 4
    assert info["model"]["name"] == Path(checkpoint).name and str(Path(checkpoint).parent) not in other.text  # no path
    assert info["model"]["dtype"] == "float32" and info["model"]["family"] == "qwen3_5_text"
    entry = info["values"]["layers.0.linear_attn.attention_queries"]
    assert entry["dims"][:2] == ["batch", "seq"] and "key_heads" in entry["dims"]


def test_values_and_every_edit_kind_equal_a_local_run(remote, local):
    ids, mask = prompts(2, 7, seed=1, pad=3)
    values = ["layers.*.layer_output", "layers.1.mlp.mlp_neurons"]
    ig = remote.instrument(values=values, edits=["layers.1.layer_output"])
    steer = torch.randn(64, generator=torch.Generator().manual_seed(2))
    cases = [None,
             {"layers.1.layer_output": qgraph.Zero(positions=[-1])},
             {"layers.0.layer_output": qgraph.Add(steer, scale=2.5, positions=[0, -2])},
             {"layers.1.mlp.mlp_neurons": qgraph.Scale(0.0, neurons=[1, 5])},
             {"layers.2.layer_mid": qgraph.Replace(torch.ones(1, 7, 64), batch=[0])}]
    for edits in cases:
        out = ig(input_ids=ids, attention_mask=mask, edits=edits)
        ref = local(ids, mask, edits=edits)
        close(out.logits, ref.logits)
        for name in ref.values:
            close(out[name], ref[name])
        assert torch.equal(out["layers[-1].layer_output"], out["layers.3.layer_output"])
    assert not torch.allclose(ig(ids, mask, edits=cases[1]).logits, ig(ids, mask).logits)  # the edit did something


def test_a_plain_http_client_gets_the_same_reply(url, local):
    ids, mask = prompts(1, 5, seed=3)
    body = pack({"values": ["layers.2.layer_output"], "edits": {"layers.2.layer_output": {"kind": "Scale",
                                                                                          "factor": 0.5}}},
                {"input_ids": ids, "attention_mask": mask})
    response = httpx.post(f"{url}/v1/run", content=body, headers={**MEDIA, "Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200
    call, tensors = parse(response.content)
    assert call["values"] == ["layers.2.layer_output"] and set(tensors) == {"logits", "value.layers.2.layer_output"}
    ref = local(ids, mask, edits={"layers.2.layer_output": qgraph.Scale(0.5)})
    close(tensors["logits"], ref.logits)
    close(tensors["value.layers.2.layer_output"], ref["layers.2.layer_output"])


def test_generate_equals_local_generate(remote, local):
    ids, mask = prompts(2, 5, seed=4, pad=2)
    ig = remote.instrument(values=["layers.2.layer_output"])
    edits = {"layers.0.layer_output": qgraph.Scale(1.5)}
    gen = ig.generate(ids, mask, max_new_tokens=6, edits=edits)
    ref = local.generate(ids, mask, max_new_tokens=6, edits=edits, values=["layers.2.layer_output"])
    assert torch.equal(gen.sequences, ref.sequences) and len(gen.steps) == len(ref.steps) == 7
    for mine, theirs in zip(gen.steps, ref.steps):
        close(mine["layers.2.layer_output"], theirs["layers.2.layer_output"])
    assert len(gen.logits) == len(gen.scores) == len(ref.logits) == 6  # one per new token, as HF's output_logits
    for mine, theirs in zip(gen.logits + gen.scores, ref.logits + ref.scores, strict=True):
        close(mine, theirs)
    bare = remote.instrument().generate(ids, mask, max_new_tokens=6)  # no values: no pass past the last choice
    assert len(bare.steps) == len(bare.logits) == 6 and torch.equal(bare.sequences, local.generate(
        ids, mask, max_new_tokens=6, values=[]).sequences)
    sampled = [ig.generate(ids, mask, max_new_tokens=4, do_sample=True, seed=7).sequences for _ in range(2)]
    assert torch.equal(*sampled)


# -- batching across researchers ------------------------------------------------------------------------
def test_concurrent_clients_are_batched_and_each_reply_is_its_own(url, remote, local):
    before = httpx.get(f"{url}/v1/health").json()
    ig = remote.instrument(values=["layers.*.layer_output"], edits=["layers.1.layer_output"])
    jobs = []
    for client in range(8):
        for n in range(3):
            seed = 100 + 10 * client + n
            ids, mask = prompts(1 + seed % 2, 3 + seed % 6, seed=seed, pad=seed % 3)
            edit = [None, qgraph.Zero(positions=[0]), qgraph.Add(torch.full((64,), 0.1 * client))][seed % 3]
            jobs.append((ids, mask, {"layers.1.layer_output": edit} if edit is not None else
                         {"layers.1.layer_output": qgraph.Scale(1.0)}))

    def send(job):
        ids, mask, edits = job
        return ig(ids, mask, edits=edits)

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(send, jobs))
    for (ids, mask, edits), out in zip(jobs, outs):
        ref = local(ids, mask, edits=edits)
        close(out.logits, ref.logits)
        close(out["layers.3.layer_output"], ref["layers.3.layer_output"])
    after = httpx.get(f"{url}/v1/health").json()
    assert after["requests"] - before["requests"] == len(jobs)
    assert after["forwards"] - before["forwards"] < len(jobs)  # some shared a forward


def test_function_edits_from_many_client_threads_at_once_each_equal_the_request_alone(url, remote, sdpa_model):
    """torch.export is not thread-safe: the clients' exports (and the server's checks of what they send, beside
    the exports of the programs they ask for) run one at a time, so none fails and each reply is its own."""
    ig = remote.instrument(values=["layers.3.layer_output"])
    names = ["layers.0.layer_output", "layers.1.layer_output", "layers.2.layer_mid", "layers.1.mlp.mlp_neurons",
             "layers.0.linear_attn.attention_output", "layers.2.layer_output", "layers.1.layer_output",
             "layers.2.layer_mid"]  # some new programs for the server (exported there), some one program
    jobs = [(prompts(1 + k % 2, 4 + k, seed=200 + k)[0], name, lambda x, k=k: x * (1 + 0.1 * k) + torch.tanh(x) * k / 8)
            for k, name in enumerate(names)]
    start = threading.Barrier(len(jobs))

    def send(job):
        ids, name, fn = job
        start.wait()  # every thread exports and sends at once
        return ig(ids, edits={name: fn})

    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(send, jobs))
    local = qgraph.instrument(sdpa_model, values=["layers.3.layer_output"], edits=list(dict.fromkeys(names)))
    for (ids, name, fn), out in zip(jobs, outs):
        alone = ig(ids, edits={name: fn})
        close(out.logits, alone.logits)
        close(out["layers.3.layer_output"], alone["layers.3.layer_output"])
        close(out.logits, local(ids, edits={name: fn}).logits)  # and what the function computes, run locally
    assert not torch.allclose(outs[1].logits, local(jobs[1][0]).logits)  # the edits did something


# -- the recipes on a remote instrument -----------------------------------------------------------------
def test_attribution_patch_patch_and_logit_lens_run_remotely(remote, local):
    clean, _ = prompts(1, 5, seed=5)
    corrupt, _ = prompts(1, 5, seed=6)
    ig = remote.instrument()
    metric = lambda logits: logits[:, -1, 3].sum() - logits[:, -1, 7].sum()  # noqa: E731
    at = ["layers.1.layer_output", "layers.2.linear_attn.attention_output"]
    mine = qgraph.attribution_patch(ig, clean, corrupt, at, metric, positions="each")
    theirs = qgraph.attribution_patch(local, clean, corrupt, at, metric, positions="each")
    for name in at:
        close(mine[name], theirs[name], 1e-4)
    assert mine[at[0]].abs().sum() > 0
    mine = qgraph.patch(ig, clean, corrupt, "layers.1.layer_output", metric, positions="each")
    theirs = qgraph.patch(local, clean, corrupt, "layers.1.layer_output", metric, positions="each")
    close(mine["layers.1.layer_output"], theirs["layers.1.layer_output"], 1e-4)
    lens, ref = ig.logit_lens(clean, positions=[0, -1], top=3), local.logit_lens(clean, positions=[0, -1], top=3)
    assert lens.positions == ref.positions == [0, 4]
    for block in ref:
        assert torch.equal(lens[block][0], ref[block][0])
        close(lens[block][1], ref[block][1])


def test_gradients_come_from_the_server(remote, local):
    ids, mask = prompts(2, 4, seed=8)
    names = {"layers.1.layer_output": {"grad": True}}
    out = remote.instrument(values=names)(ids, mask)
    ref = local.variant(names)(ids, mask)
    loss = lambda o: o.logits[:, -1].logsumexp(-1).sum()  # noqa: E731
    expected = ref.gradients(loss(ref))["layers.1.layer_output"]
    assert expected.abs().sum() > 0
    close(out.gradients(loss(out))["layers.1.layer_output"], expected, 1e-5)
    out = remote.instrument(values=names)(ids, mask)
    loss(out).backward()
    close(out.grad("layers.1.layer_output"), expected, 1e-5)
