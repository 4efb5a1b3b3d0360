"""qgraph.capture: values over a dataset to sharded safetensors (issue 14).

One tiny checkpoint and one float32 reference capture per module; the other tests compare with it.
The module turns qgraph's disk cache of exported programs on (in a dir of its own), so the child
processes (the killed capture, the torchrun ranks) load the program this process exported.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import qgraph
from qgraph.capture import CaptureMismatch, capture, load_capture
from qgraph.capture.data import documents, open_dataset, pack
from qgraph.capture.writer import STOP_AFTER_ENV
from qgraph.testing import tiny_qwen3_5

from conftest import program_cache_on

VALUES = ["layers.*.layer_output"]
TEXTS = [f"document {i}: " + "words and more words " * (i % 4) for i in range(13)]
SETUP = dict(context=32, batch_size=2, shard_rows=4, dtype=torch.float32)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _shared_program_cache(tmp_path_factory):
    with program_cache_on(tmp_path_factory, "capture-cache"):
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_qwen3_5(tmp_path_factory.mktemp("capture-model"))


@pytest.fixture(scope="module")
def loaded(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval(), AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def reference(loaded, tmp_path_factory):
    """The float32 capture of TEXTS, uninterrupted."""
    model, tokenizer = loaded
    out = tmp_path_factory.mktemp("capture") / "reference"
    return capture(model, tokenizer, TEXTS, VALUES, out, progress=False, **SETUP)


def files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "QGRAPH_PROGRESS": "0"}


def test_values_are_the_instrumented_calls_values(loaded, reference):
    model, _ = loaded
    ig = qgraph.instrument(model, values=VALUES, logits=False)
    manifest = reference.manifest
    assert manifest["complete"] and reference.shards == len(manifest["shards"]) > 2
    assert reference.tokens == sum(s["tokens"] for s in manifest["shards"])
    assert [v["layout"] for v in manifest["identity"]["values"]] == ["Residual [batch seq hidden_size]"] * 4
    assert set(manifest["versions"]) >= {"qgraph", "torch", "transformers"}
    rows = 0
    for shard in manifest["shards"]:
        path = reference.out / shard["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["sha256"] and shard["done"]
        tensors = load_file(path)
        assert shard["row_start"] == rows
        rows += shard["rows"]
        for start in range(0, shard["rows"], SETUP["batch_size"]):
            batch = slice(start, start + SETUP["batch_size"])
            with torch.inference_mode():
                out = ig(input_ids=tensors["input_ids"][batch], attention_mask=tensors["attention_mask"][batch])
            for name in ig.resolve(VALUES):
                assert torch.equal(tensors[name][batch], out[name]), name
    assert rows == reference.rows


def test_bfloat16_is_the_float32_capture_cast(loaded, reference, tmp_path):
    model, tokenizer = loaded
    run = capture(model, tokenizer, TEXTS, VALUES, tmp_path / "bf16", progress=False,
                  **{**SETUP, "dtype": torch.bfloat16})
    float32, bfloat16 = load_capture(reference.out), load_capture(run.out)
    assert len(float32) == len(bfloat16) == reference.rows
    for name in ["input_ids", "doc_id", "layers.3.layer_output"]:
        high, low = float32.values(name), bfloat16.values(name)
        assert low.dtype == (torch.bfloat16 if name.startswith("layers") else torch.int64)
        assert torch.equal(low, high.to(low.dtype))


def test_doc_ids_and_positions_at_boundaries(loaded, reference):
    _, tokenizer = loaded
    rows = list(pack([[1, 2, 3], [], [4, 5, 6, 7, 8], [9]], context=4, pad_id=0))
    assert [r.input_ids.tolist() for r in rows] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 0, 0]]
    assert [r.doc_id.tolist() for r in rows] == [[0, 0, 0, 2], [2, 2, 2, 2], [3, -1, -1, -1]]
    assert [r.position.tolist() for r in rows] == [[0, 1, 2, 0], [1, 2, 3, 4], [0, -1, -1, -1]]
    assert rows[2].attention_mask.tolist() == [1, 0, 0, 0]
    cut = list(pack([[1, 2, 3], [4, 5, 6]], context=4, max_tokens=5))
    assert [r.input_ids.tolist() for r in cut] == [[1, 2, 3, 4], [5, 0, 0, 0]]
    # the capture's stream is each text's tokens then eos, document after document
    cap = load_capture(reference.out)
    ids, docs, positions = (cap.values(name).reshape(-1) for name in ("input_ids", "doc_id", "position"))
    real = docs >= 0
    expected = [tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] for text in TEXTS]
    assert ids[real].tolist() == [t for doc in expected for t in doc]
    assert docs[real].tolist() == [i for i, doc in enumerate(expected) for _ in doc]
    assert positions[real].tolist() == [p for doc in expected for p in range(len(doc))]
    assert not real[:real.sum()].logical_not().any()  # padding only at the very end


def test_dataset_forms_give_the_same_tokens(loaded, tmp_path):
    import datasets
    _, tokenizer = loaded
    table = datasets.Dataset.from_list([{"text": t} for t in TEXTS])
    table.save_to_disk(tmp_path / "saved")
    table.to_parquet(tmp_path / "data.parquet")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (tmp_path / "data.txt").write_text("".join(t + "\n" for t in TEXTS))
    expected = list(documents(TEXTS, tokenizer))
    for source in [table, table.to_iterable_dataset(), tmp_path / "saved", tmp_path / "data.parquet",
                   tmp_path / "data.jsonl", str(tmp_path / "data.txt")]:
        examples, description = open_dataset(source)
        assert list(documents(examples, tokenizer)) == expected, description
    ids = [tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    assert list(documents(open_dataset({"input_ids": ids})[0], tokenizer)) == ids  # pre-tokenized: as given


def test_killed_capture_resumes_to_the_same_bytes(loaded, reference, checkpoint, tmp_path):
    model, tokenizer = loaded
    out = tmp_path / "resumed"
    (tmp_path / "texts.json").write_text(json.dumps(TEXTS))
    script = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from qgraph.capture import capture\n"
        "checkpoint, texts, out = sys.argv[1:]\n"
        "model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()\n"
        "capture(model, AutoTokenizer.from_pretrained(checkpoint), json.load(open(texts)), ['layers.*.layer_output'],\n"
        "        out, context=32, batch_size=2, shard_rows=4, dtype=torch.float32, progress=False)\n")
    killed = subprocess.run([sys.executable, "-c", script, str(checkpoint), str(tmp_path / "texts.json"), str(out)],
                            env={**child_env(), STOP_AFTER_ENV: "2"}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == 17, killed.stderr[-3000:]
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    assert len(list((out / "shards").glob("*.safetensors"))) == 2
    run = capture(model, tokenizer, TEXTS, VALUES, out, progress=False, **SETUP)
    assert run.skipped == 2 and run.rows == reference.rows
    assert files(out) == files(reference.out)


def test_another_setup_in_the_same_dir_is_refused(loaded, reference):
    model, tokenizer = loaded
    with pytest.raises(CaptureMismatch, match=r"the values differ .*layers\.0\.layer_output.*delete"):
        capture(model, tokenizer, TEXTS, ["layers.0.layer_output"], reference.out, progress=False, **SETUP)
    with pytest.raises(CaptureMismatch, match="dtype differs"):
        capture(model, tokenizer, TEXTS, VALUES, reference.out, progress=False, **{**SETUP, "dtype": torch.bfloat16})
    with pytest.raises(CaptureMismatch, match="data.documents differs"):
        capture(model, tokenizer, TEXTS[:-1], VALUES, reference.out, progress=False, **SETUP)
    weight = model.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        weight.mul_(2)
    try:
        with pytest.raises(CaptureMismatch, match="model weights differ"):
            capture(model, tokenizer, TEXTS, VALUES, reference.out, progress=False, **SETUP)
    finally:
        with torch.no_grad():
            weight.div_(2)
    again = capture(model, tokenizer, TEXTS, VALUES, reference.out, progress=False, **SETUP)
    assert again.skipped == again.shards  # same setup: nothing to do


@pytest.mark.slow  # two torchrun ranks (python -m pytest -m slow)
def test_torchrun_two_ranks_give_the_single_process_rows(loaded, checkpoint, tmp_path):
    model, tokenizer = loaded
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = tmp_path / "ranks"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "qgraph", "capture", "--model", str(checkpoint), "--data", str(data), "--values", *VALUES,
               "--out", str(out), "--context", "32", "--batch-size", "2", "--shard-rows", "4", "--dtype", "float32"]
    done = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "captured" in done.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert {s["rank"] for s in manifest["shards"]} == {0, 1} and manifest["identity"]["world_size"] == 2
    single = capture(model, tokenizer, data, VALUES, tmp_path / "single", progress=False, **SETUP)
    ranks, one = load_capture(out), load_capture(single.out)
    assert len(ranks) == len(one) == single.rows
    assert [ranks.row_index(i) for i in range(len(ranks))] == list(range(single.rows))
    for name in ("input_ids", "attention_mask", "doc_id", "position"):
        assert torch.equal(ranks.values(name), one.values(name)), name
    for name in qgraph.instrument(model, values=VALUES, logits=False).resolve(VALUES):
        torch.testing.assert_close(ranks.values(name), one.values(name), rtol=1e-5, atol=1e-5)


def test_bad_inputs_say_what_is_wrong(loaded, tmp_path, capsys):
    model, tokenizer = loaded
    with pytest.raises(FileNotFoundError, match="no such file"):
        capture(model, tokenizer, tmp_path / "missing.jsonl", VALUES, tmp_path / "a", progress=False, **SETUP)
    with pytest.raises(qgraph.UnknownValue, match="layers.0.no_such_value"):
        capture(model, tokenizer, TEXTS, ["layers.0.no_such_value"], tmp_path / "b", progress=False, **SETUP)
    with pytest.raises(ValueError, match="multiple of batch_size"):
        capture(model, tokenizer, TEXTS, VALUES, tmp_path / "c", progress=False, **{**SETUP, "shard_rows": 3})
    with pytest.raises(ValueError, match="no column 'body'"):
        capture(model, tokenizer, [{"text": "hi"}], VALUES, tmp_path / "d", text_column="body", progress=False, **SETUP)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "notes.txt").write_text("mine")
    with pytest.raises(CaptureMismatch, match="not empty and has no manifest.json"):
        capture(model, tokenizer, TEXTS, VALUES, tmp_path / "e", progress=False, **SETUP)
    from qgraph.cli import main
    assert main(["capture", "--model", str(tmp_path), "--data", "x.jsonl", "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model" in err and "no config.json" in err  # one line, no traceback


def test_the_public_names_are_the_capture_functions():
    assert qgraph.capture is capture and qgraph.load_capture is load_capture


def test_states_at_positions_are_the_instrumented_calls_states(loaded, tmp_path):
    model, tokenizer = loaded
    values = {"layers.0.linear_attn.state": {"positions": [7, -1]}}
    run = capture(model, tokenizer, TEXTS[:5], values, tmp_path / "state", progress=False, **SETUP)
    cap = load_capture(run.out)
    ig = qgraph.instrument(model, values=values, logits=False)
    rows = cap.values("input_ids"), cap.values("attention_mask")
    expected = torch.cat([ig(input_ids=rows[0][i:i + 2], attention_mask=rows[1][i:i + 2])["layers.0.linear_attn.state"]
                          for i in range(0, len(cap), 2)])
    assert cap.values("layers.0.linear_attn.state").shape == (len(cap), 2, *expected.shape[2:])
    assert torch.equal(cap.values("layers.0.linear_attn.state"), expected)
    assert run.manifest["identity"]["values"][0]["options"] == {"positions": [7, -1]}


def test_to_datasets_gives_saelens_columns(reference, tmp_path):
    from datasets import load_from_disk
    cap = load_capture(reference.out)
    mask = cap.values("attention_mask")
    full = int(mask.all(dim=1).sum())  # the rows with no padding: all but the last
    assert full == len(cap) - 1 and mask[-1].sum() < mask.shape[1]
    with pytest.warns(UserWarning, match=f"leaves out the capture's last row.* its {int(mask[-1].sum())} real tokens "
                                         f"are not in the dataset, which has {full} rows"):
        dataset = cap.to_datasets(tmp_path / "hf")
    assert set(load_from_disk(str(tmp_path / "hf")).column_names) == set(dataset.column_names)
    assert "token_ids" in dataset.column_names and "blocks.0.hook_resid_post" in dataset.column_names
    dataset = dataset.with_format("torch")
    assert torch.equal(dataset[:]["token_ids"], cap.values("input_ids")[:full].int())
    for block in range(len([c for c in dataset.column_names if c.endswith("hook_resid_post")])):
        assert torch.equal(dataset[:][f"blocks.{block}.hook_resid_post"],
                           cap.values(f"layers.{block}.layer_output")[:full])
    with pytest.raises(KeyError, match="not in this capture"):
        cap.to_datasets(names=["layers.0.mlp.mlp_output"])
