"""qgraph.capture's integrity: damaged shards, edited manifests, the weights' fingerprint, inputs.

Each test damages a copy of one float32 reference capture (TEXTS, uninterrupted) and checks that
the reader refuses it by the shard's name, and that rerunning the capture repairs it to the
reference's bytes.
"""
from __future__ import annotations

import json
import shutil
import struct
import warnings

import numpy as np
import pytest
import torch

from qgraph.capture import CaptureCorrupt, CaptureMismatch, capture, load_capture
from qgraph.capture.data import documents, open_dataset
from qgraph.identity import model_identity
import qgraph.identity as identity_module

from conftest import program_cache_on
from test_capture import SETUP, TEXTS, VALUES, files

SHARD = "shards/r0-{:05d}.safetensors"


@pytest.fixture(scope="module", autouse=True)
def _shared_program_cache(tmp_path_factory):
    with program_cache_on(tmp_path_factory, "capture-integrity-cache"):
        yield


@pytest.fixture(scope="module")
def loaded(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval(), AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def reference(loaded, tmp_path_factory):
    model, tokenizer = loaded
    run = capture(model, tokenizer, TEXTS, VALUES, tmp_path_factory.mktemp("integrity") / "reference",
                  progress=False, **SETUP)
    assert run.shards >= 4
    return run


@pytest.fixture
def copy(reference, tmp_path):
    """A copy of the reference capture to damage, and its manifest."""
    out = tmp_path / "copy"
    shutil.copytree(reference.out, out)
    return out, json.loads((out / "manifest.json").read_text())


def recapture(loaded, out):
    model, tokenizer = loaded
    return capture(model, tokenizer, TEXTS, VALUES, out, progress=False, **SETUP)


def set_float(path, name: str, value: float) -> None:
    """Overwrite the first element of float32 tensor ``name`` in the shard at ``path``, in place."""
    data = bytearray(path.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    start = 8 + header + json.loads(data[8:8 + header])[name]["data_offsets"][0]
    data[start:start + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["changed", "truncated"])
def test_a_damaged_shard_is_never_read_and_a_rerun_captures_it_again(loaded, reference, copy, damage):
    out, _ = copy
    path = out / SHARD.format(1)
    if damage == "changed":
        size = path.stat().st_size
        set_float(path, "layers.3.layer_output", 1e35)
        assert path.stat().st_size == size
    else:
        path.write_bytes(path.read_bytes()[:-100])
    expected = load_capture(reference.out)
    if damage == "changed":  # the header is sound: the capture opens, shard 0 reads, shard 1 does not
        cap = load_capture(out)
        assert torch.equal(cap[0]["layers.3.layer_output"], expected[0]["layers.3.layer_output"])
        with pytest.raises(CaptureCorrupt, match=r"r0-00001\.safetensors does not have the sha256.*rerun the capture"):
            cap[SETUP["shard_rows"]]
    else:
        with pytest.raises(CaptureCorrupt, match=r"r0-00001\.safetensors has \d+ bytes where .* records \d+"):
            load_capture(out)
    with pytest.warns(UserWarning, match=r"r0-00001\.safetensors .*capturing it again"):
        run = recapture(loaded, out)
    assert run.skipped == reference.shards - 1
    assert files(out) == files(reference.out)


def swap(manifest, *keys):
    first, second = manifest["shards"][:2]
    for key in keys:
        first[key], second[key] = second[key], first[key]


def last_rows(manifest, change: int):
    """Change the row count of the last shard, and the manifest's total with it."""
    manifest["shards"][-1]["rows"] += change
    manifest["rows"] += change


LAST_ROWS = r"r0-0000\d\.safetensors is not the shard .*rows \d in the file, \d in the manifest; its tensors have \d"
EDITS = {  # an edit of the manifest -> what the error says
    "entries' row_start swapped": (lambda m: swap(m, "row_start"),
                                   r"entry for shards/r0-00000\.safetensors .*row_start 4 where shard 0 .* has 0"),
    "entries' files swapped": (lambda m: swap(m, "file", "sha256", "bytes"),
                               r"entry for shards/r0-00001\.safetensors .*file"),
    "a row count lowered": (lambda m: m["shards"][0].update(rows=3) or m.update(rows=m["rows"] - 1),
                            r"entry for shards/r0-00000\.safetensors .*rows 3 where a shard holds 4"),
    "the last row count lowered": (lambda m: last_rows(m, -1), LAST_ROWS),
    "the last row count raised": (lambda m: last_rows(m, +1), LAST_ROWS),
    "an entry left out": (lambda m: m["shards"].pop(1), r"entry for shards/r0-00002\.safetensors .*index 2 where"),
    "the total raised": (lambda m: m.update(rows=m["rows"] + 1), r"says rows \d+, but its shards hold"),
    "an older format": (lambda m: m.update(format="qgraph-capture/1"), r"this qgraph reads qgraph-capture/2"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_manifest_is_refused_by_shard_and_a_rerun_rewrites_it(loaded, reference, copy, edit):
    out, manifest = copy
    change, message = EDITS[edit]
    change(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CaptureCorrupt, match=message):
        load_capture(out)
    if edit != "an older format":  # that one is refused as another setup instead
        recapture(loaded, out)
        assert files(out) == files(reference.out)


def test_shard_files_swapped_on_disk_are_told_by_their_own_metadata(loaded, reference, copy):
    out, manifest = copy
    first, second = out / SHARD.format(0), out / SHARD.format(1)
    first.rename(out / "swap"), second.rename(first), (out / "swap").rename(second)
    swap(manifest, "sha256", "bytes", "tokens", "tokens_sha256")  # the hashes follow the files: only the files tell
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CaptureCorrupt, match=r"r0-00000\.safetensors is not the shard .*index 1 in the file, 0 in the "
                                             r"manifest; row_start 4 in the file, 0 in the manifest"):
        load_capture(out)
    with pytest.warns(UserWarning, match="capturing it again"):
        recapture(loaded, out)
    assert files(out) == files(reference.out)


def test_a_manifest_that_is_not_json_is_named(copy):
    out, _ = copy
    (out / "manifest.json").write_text('{"format": "qgraph-capture/2", "rows"')
    with pytest.raises(CaptureCorrupt, match=r"manifest\.json is not a readable capture manifest"):
        load_capture(out)


def weights_sha256(module):
    return identity_module.weights_sha256(module)


def test_the_weights_fingerprint_sees_every_element(monkeypatch):
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        module = torch.nn.Linear(5, 3).to(dtype)
        module.register_buffer("frequencies", torch.rand(4), persistent=False)
        base = weights_sha256(module)
        seen = {base}
        for tensor in [*module.parameters(), *module.buffers()]:
            for index in range(tensor.numel()):
                with torch.no_grad():
                    old = tensor.view(-1)[index].item()
                    tensor.view(-1)[index] = old + 1
                    seen.add(weights_sha256(module))
                    tensor.view(-1)[index] = old
        assert len(seen) == 1 + 3 * 5 + 3 + 4 and weights_sha256(module) == base, dtype
        with monkeypatch.context() as patch:  # hashed a chunk at a time (as a GPU tensor is): the same hash
            patch.setattr(identity_module, "CHUNK", 7)
            assert weights_sha256(module) == base


def test_a_resume_after_one_neuron_is_zeroed_is_refused(loaded, copy):
    model, tokenizer = loaded
    out, _ = copy
    down = model.model.layers[1].mlp.down_proj.weight  # [hidden, intermediate]: neuron 1 is column 1
    before = model_identity(model)
    saved = down[:, 1].clone()
    with torch.no_grad():
        down[:, 1] = 0
    try:
        assert model_identity(model)["weights_sha256"] != before["weights_sha256"]
        with pytest.raises(CaptureMismatch, match="model weights differ"):
            capture(model, tokenizer, TEXTS, VALUES, out, progress=False, **SETUP)
    finally:
        with torch.no_grad():
            down[:, 1] = saved
    assert model_identity(model) == before


def test_a_capture_that_failed_before_its_first_shard_is_taken_over(loaded, reference, tmp_path):
    model, tokenizer = loaded
    out = tmp_path / "early"
    rows = [{"text": text} for text in TEXTS]
    with pytest.raises(ValueError, match="no column 'body'"):
        capture(model, tokenizer, rows, VALUES, out, text_column="body", progress=False, **SETUP)
    assert (out / "manifest.json").is_file() and not list((out / "shards").glob("*.safetensors"))
    capture(model, tokenizer, rows, VALUES, out, progress=False, **SETUP)
    assert files(out) == files(reference.out)


def test_token_ids_as_numpy_are_token_ids(loaded):
    _, tokenizer = loaded
    ids = [tokenizer(text)["input_ids"] for text in TEXTS[:3]]
    given = [np.array(ids[0]), [np.int64(t) for t in ids[1]], {"input_ids": np.array(ids[2], dtype=np.int32)}]
    assert list(documents(given)) == ids  # no tokenizer needed: they are token ids
    assert list(documents(open_dataset(np.array([ids[0][:4], ids[1][:4]]))[0])) == [ids[0][:4], ids[1][:4]]
    with pytest.raises(ValueError, match=r"token ids are a 1-D sequence of ints, got a ndarray .*float64"):
        list(documents([np.array([1.5, 2.0])]))


def test_an_empty_capture_says_it_has_no_rows(loaded, tmp_path):
    model, tokenizer = loaded
    run = capture(model, tokenizer, [], VALUES, tmp_path / "empty", progress=False, **SETUP)
    cap = load_capture(run.out)
    assert run.rows == len(cap) == 0
    with pytest.raises(ValueError, match="holds no rows"):
        cap.to_datasets()
    with pytest.raises(KeyError, match="'layers.9.layer_output' is not in this capture"):
        cap.values("layers.9.layer_output")
    one = load_capture(capture(model, tokenizer, TEXTS[:1], VALUES, tmp_path / "one", progress=False, **SETUP).out)
    assert len(one) == 1 and not one[0]["attention_mask"].all()
    with pytest.raises(ValueError, match=r"the capture's only row is padded \(\d+ real tokens of 32\)"):
        one.to_datasets()
