"""Saved programs: ``ig.save`` then ``qgraph.load`` gives the instrumented model's values, in a fresh
process that never imports the modeling file; edits at saved slots; refusals by name."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

import qgraph
from qgraph.testing import tiny_qwen3_5

from conftest import random_ids

VALUES = {"layers.0.linear_attn.state": {"positions": [0, -1]}, "layers.*.layer_output": {},
          "layers.3.self_attn.attention_gate": {}}
EDIT = {"layers.1.layer_output": qgraph.Zero(positions=[-1])}


@pytest.fixture(scope="session")
def saved(sdpa_model, tmp_path_factory):
    """The tiny model instrumented with states at positions (a per-value input), a fixed edit and a
    slot for per-call edits, its program saved without weights."""
    ig = qgraph.instrument(sdpa_model, values=VALUES,
                           edits={"layers.2.mlp.mlp_neurons": qgraph.Zero(neurons=[0, 1]), "layers.1.layer_output": None})
    path = tmp_path_factory.mktemp("saved") / "probe.pt2"
    ig.save(path)
    return ig, path


def _equal(expected, got):
    assert (expected.logits - got.logits).abs().max() <= 1e-6
    assert set(got.values) == set(expected.values)
    for name in expected.values:
        assert torch.allclose(expected[name], got[name], atol=1e-6, rtol=0), name


def test_fresh_process_never_imports_the_modeling_file(saved, checkpoint, tmp_path):
    """Loaded in a new process with the weights of the checkpoint folder (its tied embedding stored
    once): the values and a per-call edit's equal the instrumented model's."""
    ig, path = saved
    assert not path.with_suffix(".safetensors").exists()
    ids = random_ids(2, 13, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    script = textwrap.dedent(f"""
        import sys, torch, qgraph
        inputs = torch.load({str(tmp_path / 'inputs.pt')!r})
        program = qgraph.load({str(path)!r}, weights={str(checkpoint)!r})
        plain = program(inputs["ids"], inputs["mask"])
        edited = program(inputs["ids"], inputs["mask"], edits={{"layers[1].layer_output": qgraph.Zero(positions=[-1])}})
        modeling = [name for name in sys.modules if ".modeling_qwen" in name]
        torch.save({{"plain": (plain.logits, plain.values), "edited": (edited.logits, edited.values),
                    "modeling": modeling}}, {str(tmp_path / 'out.pt')!r})
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(tmp_path / "out.pt")
    assert result["modeling"] == []
    _equal(ig(ids, mask), qgraph.Output(*result["plain"]))
    expected = ig(ids, mask, edits=EDIT)
    _equal(expected, qgraph.Output(*result["edited"]))
    assert (expected.logits - ig(ids, mask).logits).abs().max() > 1e-3  # the edit did something


def test_weights_from_the_model_and_gradients(saved, sdpa_model):
    """Loaded with weights=model: the values equal the in-memory program's, and gradients reach the
    model's parameters as through it."""
    ig, path = saved
    program = qgraph.load(path, weights=sdpa_model)
    ids = random_ids(1, 9, seed=5)
    _equal(ig(ids, edits=EDIT), program(ids, edits=EDIT))
    weight = sdpa_model.model.layers[1].mlp.down_proj.weight
    grads = []
    for run in (ig, program):
        weight.grad = None
        run(ids).logits.square().mean().backward()
        grads.append(weight.grad.clone())
    weight.grad = None
    assert grads[0].abs().max() > 0 and torch.allclose(grads[0], grads[1], atol=1e-7)


def _with_meta(path, out, **changes):
    """A copy of the saved program at ``path`` whose qgraph.json has ``changes``."""
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(out, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename.endswith("/extra/qgraph.json"):
                data = json.dumps({**json.loads(data), **changes}).encode()
            target.writestr(item, data)
    return out


def test_refusals(saved, tmp_path):
    ig, bare = saved
    with pytest.raises(qgraph.SavedProgramError, match="probe.pt2 was saved without weights: load it with weights=model"):
        qgraph.load(bare)
    with pytest.raises(qgraph.EditError, match="'layers.2.layer_output' is not an edit slot of probe.pt2; its slots "
                                               "are layers.1.layer_output"):
        qgraph.load(bare, weights=ig.model)(random_ids(1, 4), edits={"layers.2.layer_output": qgraph.Zero()})
    with pytest.raises(ValueError, match="save to a .pt2 file"):
        ig.save(tmp_path / "probe.pt")
    other = tiny_qwen3_5(tmp_path / "other", hidden_size=48)
    with pytest.raises(qgraph.SavedProgramError, match=r"weights do not fit probe.pt2: \S+ is \(\d+, 64\) "
                                                       r"float32 there, \(\d+, 48\) float32 in .*other"):
        qgraph.load(bare, weights=other)
    with pytest.raises(qgraph.SavedProgramError, match="weights do not fit probe.pt2: the model has no"):
        qgraph.load(bare, weights=torch.nn.Linear(2, 2))
    versions = json.loads(zipfile.ZipFile(bare).read(next(n for n in zipfile.ZipFile(bare).namelist()
                                                          if n.endswith("qgraph.json"))))["versions"]
    old = _with_meta(bare, tmp_path / "old.pt2", versions={**versions, "torch": "2.0.0"})
    with pytest.raises(qgraph.SavedProgramError, match=r"old.pt2 was saved by torch 2.0.0; this is torch 2\.13"):
        qgraph.load(old, weights=ig.model)
    newer = _with_meta(bare, tmp_path / "newer.pt2", versions={**versions, "qgraph": "9.9"})
    with pytest.raises(qgraph.SavedProgramError, match=r"newer.pt2 was saved by qgraph 9.9"):
        qgraph.load(newer, weights=ig.model)
    (tmp_path / "junk.pt2").write_bytes(b"not a zip")
    with pytest.raises(qgraph.SavedProgramError, match="junk.pt2 is not a saved program"):
        qgraph.load(tmp_path / "junk.pt2")
