"""Stages: a program cut at block boundaries (``instrument(..., stages=...)``), run in one process and
as a two-process pipeline under torchrun (gloo): logits and every value equal the single-process
program's; an edit on stage 2 changes only what follows it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qgraph

from conftest import program_cache_on, random_ids

VALUES = ["layers.*.layer_output", "layers.0.linear_attn.states", "layers.3.self_attn.attention_gate"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _shared_program_cache(tmp_path_factory):
    with program_cache_on(tmp_path_factory, "stages-cache"):
        yield


@pytest.fixture(scope="module")
def model(checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def single(model):
    return qgraph.instrument(model, values=VALUES, edits=["layers.2.layer_output"])


def _inputs():
    ids = random_ids(3, 11, seed=9)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


EDIT = {"layers.2.layer_output": qgraph.Zero(positions=[-1])}


def _same(expected: qgraph.Output, logits, values, names, atol=0.0):
    if logits is not None:
        assert (expected.logits - logits).abs().max() <= atol
    for name in names:
        assert (expected[name] - values[name]).abs().max() <= atol, name


def test_in_one_process_stages_give_the_single_program(model, single):
    ids, mask = _inputs()
    expected, edited = single(ids, mask), single(ids, mask, edits=EDIT)
    for stages in (2, [1, 3], qgraph.Stages(4, microbatches=2)):
        staged = qgraph.instrument(model, values=VALUES, edits=["layers.2.layer_output"], stages=stages)
        exact = 0.0 if not isinstance(stages, qgraph.Stages) else 1e-6  # micro-batches: other matmul shapes
        got = staged(ids, mask)
        _same(expected, got.logits, got.values, expected.values, exact)
        got = staged(ids, mask, edits=EDIT)
        _same(edited, got.logits, got.values, edited.values, exact)


def test_two_processes_under_torchrun(model, single, checkpoint, tmp_path):
    ids, mask = _inputs()
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "tests" / "stages_worker.py"), str(checkpoint), str(tmp_path / "inputs.pt"), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "QGRAPH_PROGRESS": "0"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    expected, edited = single(ids, mask), single(ids, mask, edits=EDIT)
    first = ["layers.0.layer_output", "layers.1.layer_output", "layers.0.linear_attn.states"]
    second = ["layers.2.layer_output", "layers.3.layer_output", "layers.3.self_attn.attention_gate"]
    # each rank returns what its stage computed: blocks 0-1 on rank 0, blocks 2-3 and the logits on rank 1
    (logits0, values0), (logits1, values1) = ranks[0]["plain"], ranks[1]["plain"]
    assert logits0 is None and sorted(values0) == sorted(first) and sorted(values1) == sorted(second)
    _same(expected, logits1, values1, second)
    _same(expected, None, values0, first)
    # the edit at block 2 (stage 2): stage 1's values are the plain ones, what follows is edited
    (_, edited0), (edited_logits, edited1) = ranks[0]["edited"], ranks[1]["edited"]
    _same(expected, None, edited0, first)
    _same(edited, edited_logits, edited1, second)
    assert (edited.logits - expected.logits).abs().max() > 1e-3
    # micro-batches of the batch of 3 flow through the stages, every value gathered on rank 0
    gathered_logits, gathered = ranks[0]["gathered"]
    _same(expected, gathered_logits, gathered, first + second, atol=1e-6)
    # built on meta: each rank read only its own blocks' weights, and computes the same
    read0, read1 = ranks[0]["read"], ranks[1]["read"]
    assert any(".layers.1." in name for name in read0) and not any(".layers.2." in name for name in read0)
    assert any(".layers.3." in name for name in read1) and not any(".layers.0." in name for name in read1)
    assert "model.norm.weight" in read1 and "model.norm.weight" not in read0
    _same(expected, ranks[1]["meta"][0], ranks[1]["meta"][1], second)
    _same(expected, None, ranks[0]["meta"][1], first)


@pytest.mark.compat
def test_a_model_on_meta_runs_with_weights_read_from_the_checkpoint(model, single, checkpoint):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model.config).eval()
    ig = qgraph.instrument(meta, values=VALUES, edits=["layers.2.layer_output"])
    ids, mask = _inputs()
    with pytest.raises(RuntimeError, match="is on the meta device .* load them with ig.load_weights"):
        ig(ids, mask)
    names = ig.load_weights(checkpoint)
    assert "model.layers.3.mlp.down_proj.weight" in names and "model.rotary_emb.inv_freq" in names
    expected = single(ids, mask, edits=EDIT)
    got = ig(ids, mask, edits=EDIT)
    _same(expected, got.logits, got.values, expected.values)
    assert all(p.is_meta for p in meta.parameters())  # the model is untouched
    with pytest.raises(ValueError, match=r"the weights do not fit the model: .* is \(\d+, 64\) float32 there, "
                                         r"\(\d+, 48\) float32 in"):
        from qgraph.testing import tiny_qwen3_5
        ig.load_weights(tiny_qwen3_5(checkpoint.parent / "narrow", hidden_size=48))


def test_stage_mistakes_are_named(model):
    with pytest.raises(ValueError, match="stages=5: a model of 4 blocks splits into 1 to 4 stages"):
        qgraph.instrument(model, values=VALUES, stages=5)
    with pytest.raises(ValueError, match=r"stages=\[3, 1\]: give the first block of each stage after the first, "
                                         r"increasing"):
        qgraph.instrument(model, values=VALUES, stages=[3, 1])
    with pytest.raises(ValueError, match="stages= runs each stage eagerly; drop compile="):
        qgraph.instrument(model, values=VALUES, stages=2, compile=True)
    with pytest.raises(ValueError, match="microbatches takes a positive int"):
        qgraph.Stages(2, microbatches=0)
    with pytest.raises(NotImplementedError, match="generate does not run stages yet"):
        qgraph.instrument(model, values=VALUES, stages=2).generate(random_ids(1, 3), max_new_tokens=2)
