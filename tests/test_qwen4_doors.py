"""Qwen3.8-Flash-Next (``qwen4_exp``, issue 58) through every door: the tiny checkpoint instrumented locally, by a
``qgraph serve`` of it (``qgraph.remote``) and saved with its weights and loaded (``qgraph.load``) gives the same
streams, mixes, n-gram embeddings, sparse-attention selections and logits, an edit of the streams included, on a
left-padded batch whose selection drops keys.

The saved program calls ``qgraph::qsa_select``, so a file may call it as an attacker would: each hostile rewrite of
its arguments is refused by name (at load, by the op's fake in the sandbox's fake run, or at the call, by its kernel,
before it selects), nothing read or written (the canary), the weights byte for byte as they were.
"""
from __future__ import annotations

import hashlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import qgraph

from conftest import program_cache_on
from hostile import OPS, nodes_of, rewrite

VALUES = ["layers.*.layer_output", "layers.1.attention_mix.*", "layers.3.mlp_mix.injection_weights", "layers.2.ple.*",
          "layers.*.self_attn.selected_tokens", "layers.3.self_attn.block_scores", "final_mix.mix_weights",
          "final_norm_output"]
SLOTS = ["layers.*.layer_output"]
SELECT = "torch.ops.qgraph.qsa_select.default"


@pytest.fixture(scope="module")
def checkpoint(qwen4_checkpoint):
    return qwen4_checkpoint


@pytest.fixture(scope="module")
def model(qwen4_models):
    return qwen4_models("sdpa")


@pytest.fixture(scope="module")
def cache_on(tmp_path_factory):
    """The disk cache of exported programs on: the server's process loads the program from it where this worker
    exported the model here (one shared with other files may have been exported before: the server exports it)."""
    with program_cache_on(tmp_path_factory, "qwen4-doors-cache"):
        yield


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory, cache_on):
    """(the local instrument, its program saved with its weights beside it)."""
    local = qgraph.instrument(model, values=VALUES, edits=SLOTS)
    return local, local.save(tmp_path_factory.mktemp("saved") / "qwen4.qgraph", weights=True)


@pytest.fixture(scope="module")
def doors(saved, checkpoint, tmp_path_factory):
    """The local instrument, the same asked of a ``qgraph serve`` of the checkpoint, and the saved one loaded."""
    from tests.serving import KEY, start_server
    local, path = saved
    process, url = start_server(checkpoint, tmp_path_factory.mktemp("serve"))
    try:
        yield {"local": local, "remote": qgraph.remote(url, api_key=KEY).instrument(VALUES, edits=SLOTS),
               "loaded": qgraph.load(path)}
    finally:
        process.kill()
        process.wait(30)


def padded():
    """Three rows of 23 tokens left-padded by 0, 6 and 15: past the budget of 8 (the selection drops keys), a row
    with no complete block past it, an eos inside the first row (a new n-gram segment)."""
    ids = torch.randint(0, 256, (3, 23), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 6, 15)):
        mask[row, :pad], ids[row, :pad] = 0, 256
    ids[0, 12] = 256
    return ids, mask


@pytest.mark.slow  # the remote door starts a server process
def test_every_door_gives_the_local_values_and_logits(doors, model):
    ids, mask = padded()
    outs = {door: instrument(ids, mask) for door, instrument in doors.items()}
    local = outs["local"]
    assert doors["remote"].values == doors["loaded"].values == doors["local"].values
    assert {"layers.2.ple.ngram_embeddings", "layers.1.self_attn.selected_tokens"} <= set(local.values)
    assert int(local["layers.3.self_attn.selected_tokens"][0, -1].sum()) == 8 + 23 % 4  # the selection drops keys
    for door in ("remote", "loaded"):
        for name in doors["local"].values:
            mine, theirs = outs[door][name], local[name]
            assert mine.shape == theirs.shape and mine.dtype == theirs.dtype, (door, name)
            if theirs.dtype == torch.bool:
                assert torch.equal(mine, theirs), (door, name)
            else:
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5, equal_nan=True, msg=f"{door} {name}")
        torch.testing.assert_close(outs[door].logits, local.logits, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(local.logits, model(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)


@pytest.mark.slow  # the remote door starts a server process
def test_an_edit_of_the_streams_is_the_same_through_every_door(doors):
    """A steering vector per stream added to block 1's streams: the same logits and later streams on every door,
    and not the unedited ones."""
    ids, mask = padded()
    vector = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    edits = {"layers.1.layer_output": qgraph.Add(vector)}
    outs = {door: instrument(ids, mask, edits=edits) for door, instrument in doors.items()}
    plain = doors["local"](ids, mask)
    assert not torch.allclose(outs["local"].logits, plain.logits, atol=1e-3)
    torch.testing.assert_close(outs["local"]["layers.1.layer_output"], plain["layers.1.layer_output"] + vector)
    for door in ("remote", "loaded"):
        torch.testing.assert_close(outs[door].logits, outs["local"].logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[door]["layers.3.layer_output"], outs["local"]["layers.3.layer_output"],
                                   rtol=1e-5, atol=1e-5)


def test_the_saved_programs_work_counts_what_its_call_computes(saved, model):
    """The sandbox's count of a call's work (the selection's included) is at least torch's count of its
    multiply-adds and within a small factor of it, and grows with the call."""
    loaded = qgraph.load(saved[1], weights=model)
    for batch, length in ((1, 9), (2, 40)):
        ids = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(length))
        with FlopCounterMode(display=False) as counter:
            loaded(ids)
        counted = counter.get_total_flops()
        assert counted <= loaded.work(batch, length) <= 4 * counted, (batch, length)


# -- qsa_select in a hostile file -----------------------------------------------------------------------------------


def selections(data):
    return [node for node in nodes_of(data, "call_function") if node["target"] == SELECT]


def changed(part: int, value):
    """A change of graph.json setting argument ``part`` of every qsa_select call to ``value`` (or to ``value(node,
    data)``, nodes it needs put before the call)."""
    def change(data):
        graph = data["graph"]["nodes"]
        for node in selections(data):
            made = value(node, data) if callable(value) else ([], value)
            at = graph.index(node)
            graph[at:at] = made[0]
            node["args"][part] = made[1]
    return change


def swapped(data):
    """qsa_select called with its mask where its scores go and its scores where its mask goes."""
    for node in selections(data):
        node["args"][:2] = node["args"][1::-1]


def length(node, data):
    """The call's length (a size of the mask) as the ratio: an int at the call, a symbol in the fake run."""
    size = {"name": f"hostile_size_{node['name']}", "op": "call_function", "target": f"{OPS}.sym_size.int",
            "args": [node["args"][1], 2]}
    return [size], {"node": size["name"]}


def transposed(node, data):
    """The mask transposed: each query sees the keys from itself on (the last query one key), not a causal mask."""
    flipped = {"name": f"hostile_flip_{node['name']}", "op": "call_function", "target": f"{OPS}.transpose.int",
               "args": [node["args"][1], 1, 2]}
    return [flipped], {"node": flipped["name"]}


def hostile_cases():
    """(case, change of graph.json, what the refusal says, whether it is refused at load rather than at the call)."""
    return [
        ("a ratio of 0", changed(2, 0), r"takes ratio as an int of at least 1 \(the indexer's config\), not 0", True),
        ("a negative budget", changed(3, -5), "takes top as an int of at least 0", True),
        ("a ratio that is the call's length", changed(2, length), "takes ratio as an int of at least 1", True),
        ("a ratio the scores were not pooled by", changed(2, 3), r"takes scores \[batch query key // ratio\]", True),
        ("the mask where the scores go", swapped, "takes float scores", True),
        ("a float mask", changed(1, lambda n, d: ([], n["args"][0])), r"takes a bool mask \[batch query key\]", True),
        ("a mask that is not causal", changed(1, transposed), "causal attention_mask", False),
    ]


def fingerprint(model, path):
    return [hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for t in model.state_dict().values()], path.read_bytes()


def test_hostile_selection_arguments_are_refused_by_name(saved, model, canary, tmp_path):
    """Each rewrite of qsa_select's arguments is a refusal naming the op's argument, at load (and by ``qgraph check``)
    where the fake run sees it, else at the call before the selection; the weights, the file and the canary's folder
    are as they were."""
    from qgraph.cli import main
    path = saved[1]
    ids, mask = padded()
    before = fingerprint(model, path)
    for index, (case, change, message, at_load) in enumerate(hostile_cases()):
        bad = rewrite(path, tmp_path / f"select{index}.qgraph", graph=change)
        if at_load:
            with pytest.raises(qgraph.SavedProgramError, match=r"node \w+ \(qgraph.qsa_select.default\) does not fit "
                                                               r"its arguments: qgraph::qsa_select " + message):
                qgraph.load(bad, weights=model)
                pytest.fail(f"{case}: loaded")
            if index == 0:  # the same refusal through the command line (each refusal itself is tested at load)
                assert main(["check", str(bad)]) == 2, case
        else:
            loaded = qgraph.load(bad, weights=model)
            with pytest.raises(qgraph.NotSupported, match=message):
                loaded(ids, mask)
                pytest.fail(f"{case}: ran")
    assert fingerprint(model, path) == before
    torch.testing.assert_close(qgraph.load(path, weights=model)(ids, mask).logits, saved[0](ids, mask).logits,
                               rtol=0, atol=0)


def test_a_budget_past_any_prompt_allocates_nothing_for_it(saved, model, canary, tmp_path):
    """A budget of 2**62 blocks: the kernel allocates by its tensors alone (the canary's peak memory), so the call
    runs and keeps every visible key, as a budget past the prompt's blocks does."""
    ids, mask = padded()
    loaded = qgraph.load(rewrite(saved[1], tmp_path / "budget.qgraph", graph=changed(3, 2**62)), weights=model)
    out = loaded(ids, mask)
    real = mask.bool()
    causal = torch.ones(23, 23, dtype=torch.bool).tril() & real[:, None, :] & real[:, :, None]
    for block in (1, 3):
        assert torch.equal(out[f"layers.{block}.self_attn.selected_tokens"], causal), block
