"""Sharded checkpoints (an index and its shards, as Hugging Face writes them): a model built on meta and
cut into stages opens only the shards that hold its stage's tensors (checked in one process, each
stage's process played in turn); a missing shard and an index that does not match its shards are
refused by name; shard sizes read as Hugging Face reads them."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

import qgraph
from qgraph import weights


@pytest.fixture(scope="module")
def sharded(sdpa_model, tmp_path_factory):
    """The tiny model saved by transformers in shards of at most 100KB (10 of them) with its index."""
    folder = tmp_path_factory.mktemp("sharded")
    sdpa_model.save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 4
    return folder


def _opened(monkeypatch) -> list:
    """The files ``qgraph.weights`` opens with safe_open from now on (reading their tensors)."""
    seen, real = [], weights.safe_open

    def spy(file, *args, **kwargs):
        seen.append(file.name)
        return real(file, *args, **kwargs)

    monkeypatch.setattr(weights, "safe_open", spy)
    return seen


def test_a_stage_opens_only_its_shards(sdpa_model, sharded, monkeypatch):
    """Each stage's process (``local_inputs`` as torchrun's rank would have it) opens exactly the shards
    holding its tensors (the tied embedding's for both: the last stage's lm_head reads it), never one
    holding only the other stage's; with the other stage's shards gone it still loads, while the other
    stage is refused by the missing shard's name. Without the index, each file's header says the same."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(sdpa_model.config).eval()
    ig = qgraph.instrument(meta, values=["layers.*.layer_output"], stages=2)
    pipeline = ig.program_for(ig.exported.images).runner.pipeline
    stages = [[where[0] for kind, *where in inputs if kind == "input"] for inputs in pipeline.plan.inputs]
    table = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    state, tied, needs = sdpa_model.state_dict(), weights.tied_groups(meta), []
    for stage in stages:
        # this process plays the stage's rank (on the class: load_weights rebuilds the program)
        monkeypatch.setattr(type(pipeline), "local_inputs", lambda self, count, stage=stage: stage)
        opened = _opened(monkeypatch)
        read = ig.load_weights(sharded)
        stored = [name if name in table else "model.embed_tokens.weight" for name in read]
        assert "lm_head.weight" in read and set(stored) <= set(table)
        planned = [file.name for file in weights.shards(sharded, read, tied)]
        assert sorted(opened) == sorted({table[name] for name in stored}) == sorted(planned)
        needs.append(set(opened))
        assert all(torch.equal(tensor, state[name]) for name, tensor in weights.read(sharded, read, tied).items())
    assert needs[0] - needs[1] and needs[1] - needs[0]  # each stage has shards of its own
    index = sharded / "model.safetensors.index.json"
    hidden = index.rename(sharded / "index.json")
    try:
        assert {file.name for file in weights.shards(sharded, read, tied)} == needs[1]  # from the headers alone
    finally:
        hidden.rename(index)
    away = needs[0] - needs[1]
    for name in away:
        (sharded / name).rename(sharded / f"{name}.away")
    try:
        ig.load_weights(sharded)  # the last stage, as above
        monkeypatch.setattr(type(pipeline), "local_inputs", lambda self, count: stages[0])
        with pytest.raises(qgraph.MissingFile, match=r"model.safetensors.index.json puts .* in (model-\d{5}-of-\d{5}"
                                                     r".safetensors), which is not in .*: copy the shards the index "
                                                     r"names beside it") as refused:
            ig.load_weights(sharded)
        assert re.search(r" in (\S+), which", str(refused.value)).group(1) in away  # a shard only stage 0 reads
    finally:
        for name in away:
            (sharded / f"{name}.away").rename(sharded / name)


def test_an_index_that_is_not_its_shards(sharded, tmp_path):
    """An index that puts a tensor in a shard without it is refused by the tensor's and the shard's
    names; one whose weight_map names a file elsewhere than beside it is no safetensors index."""
    folder = shutil.copytree(sharded, tmp_path / "copy")
    index = folder / "model.safetensors.index.json"
    table = json.loads(index.read_text())
    name = "model.layers.3.mlp.down_proj.weight"
    wrong = next(shard for shard in sorted(set(table["weight_map"].values())) if shard != table["weight_map"][name])
    table["weight_map"][name] = wrong
    index.write_text(json.dumps(table))
    with pytest.raises(qgraph.WeightsMismatch, match=rf"model.safetensors.index.json puts {name} \(1 tensor\) in "
                                                     rf"{wrong}, which does not hold it: the index is not its shards'"):
        weights.read(folder, [name])
    index.write_text(json.dumps({"weight_map": {name: "../model.safetensors"}}))
    with pytest.raises(qgraph.WeightsMismatch, match="model.safetensors.index.json is not a safetensors index"):
        weights.read(index, [name])


def test_shard_sizes():
    assert [weights.size_in_bytes(size) for size in ("5GB", "500MiB", "1.5kb", 1000)] == [
        5 * 10 ** 9, 500 * 2 ** 20, 1500, 1000]
    for bad in ("5 parsecs", 0, -1, True, 1.5, "0GB"):
        with pytest.raises(ValueError, match="max_shard_size= takes a number of bytes"):
            weights.size_in_bytes(bad)
