"""Saved programs: ``ig.save`` then ``qgraph.load`` gives the instrumented model's values, in a fresh
process that never imports the modeling file; edits at saved slots; SAEs and fixed edits traced into
the file; refusals by name; weights checked as a strict ``load_state_dict`` checks them; a model given
as the weights followed when it changes; a file that names anything but allow-listed ops refused, and
nothing in it run."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import zipfile

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import qgraph
from qgraph.testing import tiny_qwen3_5, tiny_qwen3_5_vl

from conftest import hf_logits, random_ids

VALUES = {"layers.0.linear_attn.state": {"positions": [0, -1]}, "layers.*.layer_output": {},
          "layers.3.self_attn.attention_gate": {}}
EDIT = {"layers.1.layer_output": qgraph.Zero(positions=[-1])}


@pytest.fixture(scope="session")
def saved(sdpa_model, tmp_path_factory):
    """The tiny model instrumented with states at positions (a per-value input), a fixed edit and a
    slot for per-call edits, its program saved without weights."""
    ig = qgraph.instrument(sdpa_model, values=VALUES,
                           edits={"layers.2.mlp.mlp_neurons": qgraph.Zero(neurons=[0, 1]), "layers.1.layer_output": None})
    path = tmp_path_factory.mktemp("saved") / "probe.qgraph"
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


@pytest.mark.compat
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
            if item.filename == "qgraph.json":
                data = json.dumps({**json.loads(data), **changes}).encode()
            target.writestr(item, data)
    return out


def test_refusals(saved, tmp_path):
    ig, bare = saved
    with pytest.raises(qgraph.SavedProgramError, match="probe.qgraph was saved without weights: load it with weights=model"):
        qgraph.load(bare)
    with pytest.raises(qgraph.EditError, match="'layers.2.layer_output' is not an edit slot of probe.qgraph; its slots "
                                               "are layers.1.layer_output"):
        qgraph.load(bare, weights=ig.model)(random_ids(1, 4), edits={"layers.2.layer_output": qgraph.Zero()})
    with pytest.raises(ValueError, match="save to a .qgraph file"):
        ig.save(tmp_path / "probe.pt2")
    other = tiny_qwen3_5(tmp_path / "other", hidden_size=48)
    with pytest.raises(qgraph.SavedProgramError, match=r"weights do not fit probe.qgraph: \S+ is \(\d+, 64\) "
                                                       r"float32 there, \(\d+, 48\) float32 in .*other"):
        qgraph.load(bare, weights=other)
    with pytest.raises(qgraph.SavedProgramError, match="weights do not fit probe.qgraph: the model has no"):
        qgraph.load(bare, weights=torch.nn.Linear(2, 2))
    versions = json.loads(zipfile.ZipFile(bare).read("qgraph.json"))["versions"]
    old = _with_meta(bare, tmp_path / "old.qgraph", versions={**versions, "torch": "2.0.0"})
    with pytest.raises(qgraph.SavedProgramError,
                       match=r"old.qgraph was saved by torch 2.0.0; this is torch " + re.escape(torch.__version__)):
        qgraph.load(old, weights=ig.model)
    newer = _with_meta(bare, tmp_path / "newer.qgraph", versions={**versions, "qgraph": "9.9"})
    with pytest.raises(qgraph.SavedProgramError, match=r"newer.qgraph was saved by qgraph 9.9"):
        qgraph.load(newer, weights=ig.model)
    with zipfile.ZipFile(tmp_path / "v2.pt2", "w") as archive:  # format 2: a torch.export archive
        archive.writestr("v2/extra/qgraph.json", json.dumps({"format": 2}))
    with pytest.raises(qgraph.SavedProgramError, match="v2.pt2 is qgraph program format 2; this qgraph reads format 5: "
                                                       "save it again"):
        qgraph.load(tmp_path / "v2.pt2", weights=ig.model)
    (tmp_path / "junk.qgraph").write_bytes(b"not a zip")
    with pytest.raises(qgraph.SavedProgramError, match="junk.qgraph is not a saved program"):
        qgraph.load(tmp_path / "junk.qgraph")
    with torch.device("meta"):
        meta = type(ig.model)(ig.model.config)
    with pytest.raises(ValueError, match="the model was built on the meta device: .* save from the model loaded with "
                                         "its weights"):
        qgraph.instrument(meta, values=["layers.1.layer_output"]).save(tmp_path / "meta.qgraph")
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(qgraph.SavedProgramError, match="junk.safetensors is not a readable safetensors file .*: give a "
                                                       ".safetensors file, a safetensors index or a checkpoint folder"):
        qgraph.load(bare, weights=tmp_path / "junk.safetensors")


STATES_OP = "torch.ops.qgraph.chunk_gated_delta_rule_states.default"


def _states_argument(index: int, value):
    """A change of graph.json setting argument ``index`` of the state-emitting node to ``value`` (or to
    ``value(data)``)."""
    def change(data):
        (node,) = [node for node in data["graph"]["nodes"] if node.get("target") == STATES_OP]
        node["args"][index] = value(data) if callable(value) else value
    return change


@pytest.mark.parametrize("index, value, message", [
    (9, 12288, r"takes chunk_size 64, the kernel's chunk, not 12288"),  # 9.8 GB for 20 tokens, were it run
    (9, 1, r"takes chunk_size 64, the kernel's chunk, not 1"),
    (7, lambda data: {"node": next(n["name"] for n in data["graph"]["nodes"] if n["op"] == "placeholder")},
     r"takes heads as 1-d int64 indices, not torch.float32 \[\d+, 64\]"),
    (10, {"dtype": "int64"}, r"takes a floating-point states_dtype, not torch.int64"),
], ids=["a chunk of 12288", "a chunk of 1", "a weight as heads", "int states"])
def test_a_state_emitting_node_qgraph_never_writes_is_refused_at_load(saved, tmp_path, index, value, message):
    ig, bare = saved
    assert qgraph.load(bare, weights=ig.model) is not None  # as saved: its chunk is 64, its positions int64
    hostile = _with_graph(bare, tmp_path / "hostile.qgraph", _states_argument(index, value))
    with pytest.raises(qgraph.SavedProgramError, match=r"\(qgraph.chunk_gated_delta_rule_states.default\) does not "
                                                       r"fit its arguments: qgraph::chunk_gated_delta_rule_states "
                                                       + message):
        qgraph.load(hostile, weights=ig.model)


def test_delta_rule_arguments_that_broadcast_are_refused_at_load(saved, tmp_path):
    """The kernels multiply values by betas before reshaping: betas [64, 1, 1] beside values [b, s, 4, 16]
    would broadcast into a tensor no output's size shows (torch's own error comes only after it is made)."""
    ig, bare = saved

    def change(data):
        nodes = data["graph"]["nodes"]
        (node,) = [node for node in nodes if node.get("target") == STATES_OP]
        nodes.insert(nodes.index(node), {"name": "hostile_beta", "op": "call_function",
                                         "target": "torch.ops.aten.zeros.default", "args": [[64, 1, 1]]})
        node["args"][4] = {"node": "hostile_beta"}
    hostile = _with_graph(bare, tmp_path / "hostile.qgraph", change)
    with pytest.raises(qgraph.SavedProgramError, match=r"does not fit its arguments: qgraph::chunk_gated_delta_rule_"
                                                       r"states takes beta of shape \[s\d+, s\d+, 4\] beside queries "
                                                       r"\[s\d+, s\d+, 2, 16\], not \[64, 1, 1\]"):
        qgraph.load(hostile, weights=ig.model)


WRITES_OP = "torch.ops.qgraph.chunk_gated_delta_rule_writes.default"


@pytest.mark.parametrize("probe", ["shift", "lift"])
def test_write_probes_of_another_shape_are_refused_at_load(sdpa_model, tmp_path, probe):
    """``lift - shift`` inside the writes kernel broadcasts its two probes: probes the graph made of other
    shapes ([64, 1, 1, 1] beside [1, seq, heads, dim]) would make a tensor no output's size shows."""
    path = qgraph.instrument(sdpa_model, values=["layers.0.linear_attn.write_values"]).save(tmp_path / "w.qgraph")
    assert qgraph.load(path, weights=sdpa_model) is not None

    def change(data):
        nodes = data["graph"]["nodes"]
        (node,) = [node for node in nodes if node.get("target") == WRITES_OP]
        nodes.insert(nodes.index(node), {"name": "hostile_probe", "op": "call_function",
                                         "target": "torch.ops.aten.zeros.default", "args": [[64, 1, 1, 1]]})
        node["args"][("shift", "lift").index(probe) + 6] = {"node": "hostile_probe"}
    hostile = _with_graph(path, tmp_path / "hostile.qgraph", change)
    with pytest.raises(qgraph.SavedProgramError, match=rf"does not fit its arguments: qgraph::chunk_gated_delta_rule_"
                                                       rf"writes takes its {probe} shaped as its values \[s\d+, s\d+, "
                                                       rf"4, 16\], not \[64, 1, 1, 1\]"):
        qgraph.load(hostile, weights=sdpa_model)


def _keys(checkpoint) -> set[str]:
    """The tensor names of a checkpoint folder, as safetensors reads them."""
    names = set()
    for file in checkpoint.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            names |= set(handle.keys())
    return names


def _listed(message: str, verb: str) -> tuple[list[str], int]:
    """The names a refusal shows after ``verb`` (``has no`` / ``holds``) and the count it gives."""
    found = re.search(rf"{verb} ((?:[\w.]+, )*[\w.]+)(?: and \d+ more)? \((\d+) tensors?\)", message)
    assert found, message
    return found.group(1).split(", "), int(found.group(2))


def _blocks(n: int) -> dict:
    """The tiny model's config with ``n`` blocks (every fourth one attention, as in its 4)."""
    return dict(num_hidden_layers=n, layer_types=["full_attention" if i % 4 == 3 else "linear_attention"
                                                  for i in range(n)])


def test_weights_of_another_size_refused_by_name(saved, sdpa_model, checkpoint, tmp_path):
    """As a strict load_state_dict: an 8-block checkpoint (or model) for the 4-block program holds
    tensors the 4-block model never had, a 2-block one lacks tensors the program reads; each refusal
    names a few and gives their count, measured against the checkpoints' and models' own names."""
    from transformers import AutoModelForCausalLM
    _, bare = saved
    big = tiny_qwen3_5(tmp_path / "big", **_blocks(8))
    extra = _keys(big) - set(sdpa_model.state_dict())
    assert len(extra) > 20 and all(name.startswith(("model.layers.4.", "model.layers.5.", "model.layers.6.",
                                                    "model.layers.7.")) for name in extra)
    with pytest.raises(qgraph.SavedProgramError, match="never had: give the weights of the model probe.qgraph was saved "
                                                       "from \\(a Qwen3_5ForCausalLM of 4 blocks\\)") as refused:
        qgraph.load(bare, weights=big)
    shown, count = _listed(str(refused.value), "holds")
    assert count == len(extra) and set(shown) <= extra and "has no" not in str(refused.value)
    big_model = AutoModelForCausalLM.from_pretrained(big)
    with pytest.raises(qgraph.SavedProgramError, match="the model holds .* that the Qwen3_5ForCausalLM it was saved "
                                                       "from never had") as refused:
        qgraph.load(bare, weights=big_model)
    shown, count = _listed(str(refused.value), "holds")
    assert count == len(set(big_model.state_dict()) - set(sdpa_model.state_dict())) and set(shown) <= extra
    small = tiny_qwen3_5(tmp_path / "small", **_blocks(2))
    lacking = _keys(checkpoint) - _keys(small)
    with pytest.raises(qgraph.SavedProgramError, match="the weights do not fit probe.qgraph: .*small has no") as refused:
        qgraph.load(bare, weights=small)
    shown, count = _listed(str(refused.value), "has no")
    assert count == len(lacking) and set(shown) <= lacking


def test_image_text_checkpoint_for_its_text_program(tmp_path):
    """The text program saved from the image-text model reads no vision weights: a file of the text
    tensors alone runs it; its checkpoint folder (vision tower included) is accepted, with the ``mtp.*``
    tensors its class ignores on load, but not with a tensor the model never had. Logits: HF's."""
    from transformers import AutoModelForImageTextToText
    folder = tiny_qwen3_5_vl(tmp_path / "vl")
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    path = qgraph.instrument(model, values=["layers.1.layer_output"]).save(tmp_path / "text.qgraph")
    ids = random_ids(2, 11, seed=7)
    expected = hf_logits(model, ids)
    text = {name: tensor for name, tensor in model.state_dict().items()
            if not name.startswith("model.visual.") and name != "lm_head.weight"}  # the head is tied
    safetensors.torch.save_file(text, tmp_path / "text.safetensors")
    (tmp_path / "vl" / "mtp.safetensors").write_bytes(
        safetensors.torch.save({"mtp.fc.weight": torch.zeros(2, 2)}))  # Hub checkpoints hold these
    assert any(name.startswith("model.visual.") for name in _keys(folder))
    for weights in (tmp_path / "text.safetensors", folder):
        torch.testing.assert_close(qgraph.load(path, weights=weights)(ids).logits, expected, rtol=0, atol=1e-5)
    stray = "model.visual.blocks.7.norm1.weight"
    assert stray not in model.state_dict()
    safetensors.torch.save_file({stray: torch.zeros(32)}, folder / "stray.safetensors")
    with pytest.raises(qgraph.SavedProgramError, match=rf"holds {re.escape(stray)} \(1 tensor\) that the "
                                                       rf"Qwen3_5ForConditionalGeneration it was saved from never had"):
        qgraph.load(path, weights=folder)


@pytest.fixture(scope="module")
def plain(sdpa_model, tmp_path_factory):
    """The tiny model's program with no edit, saved without weights (its logits are the model's)."""
    return qgraph.instrument(sdpa_model, values=["layers.1.layer_output"]).save(
        tmp_path_factory.mktemp("plain") / "plain.qgraph")


def test_model_followed_when_it_changes(plain, checkpoint):
    """Loaded with weights=model, then a block's down_proj replaced and the lm_head untied: each
    call's logits are the changed model's own HF forward; a replacement of another shape is refused."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()  # its own copy: changed below
    program = qgraph.load(plain, weights=model)
    ids = random_ids(2, 9, seed=6)
    before = program(ids).logits
    torch.testing.assert_close(before, hf_logits(model, ids), rtol=0, atol=1e-5)
    torch.manual_seed(0)
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(128, 64, bias=False)
    after = program(ids).logits
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, hf_logits(model, ids), rtol=0, atol=1e-5)
    head = model.lm_head.weight.detach()
    model.lm_head.weight = torch.nn.Parameter(head + 0.1 * torch.randn_like(head))
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    torch.testing.assert_close(program(ids).logits, hf_logits(model, ids), rtol=0, atol=1e-5)
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(100, 64, bias=False)
    with pytest.raises(qgraph.SavedProgramError, match=r"plain.qgraph: model.layers.1.mlp.down_proj.weight is \(64, 128\) "
                                                       r"float32 there, \(64, 100\) float32 in the model"):
        program(ids)


def test_an_sae_and_a_fixed_edit_are_traced_into_the_file(sdpa_model, tmp_path):
    """A TopK SAE spliced at a value (its select, dense and decode each traced alone into ops, its
    weights held once however many calls read them) and fixed edits, one a plain function: with a
    per-call edit of the SAE's features, the loaded program's logits and values are the instrumented
    model's bit for bit. Where the instrumented model refuses a fixed edit's position (out of range
    for one token) the loaded program's assertion refuses it. A fixed edit whose code takes another
    path at some length cannot be saved, and says so."""
    from qgraph.saes import SAE
    from qgraph.saes.fixtures import write_saelens
    sae = SAE.load(write_saelens(tmp_path / "sae", d_in=64, d_sae=96, architecture="topk", k=4,
                                 hook_name="blocks.1.hook_resid_post", seed=2))
    values = ["layers.1.sae.features", "layers.1.sae.error", "layers.2.layer_output"]
    ig = qgraph.instrument(sdpa_model, values=values, saes={"layers.1.layer_output": sae},
                           edits={"layers.1.sae.features": None, "layers.2.mlp.mlp_neurons": lambda t: t * 0.5,
                                  "layers.0.layer_output": qgraph.Zero(positions=[1])})
    path = ig.save(tmp_path / "sae.qgraph")
    held = safetensors.torch.load(zipfile.ZipFile(path).read("tensors.safetensors"))
    assert [tuple(t.shape) for t in held.values()].count(tuple(sae.W_dec.shape)) == 1  # decode is called twice
    edits = {"layers.1.sae.features": qgraph.Scale(2.0, neurons=[0, 5])}
    ids = random_ids(2, 7, seed=8)
    program = qgraph.load(path, weights=sdpa_model)
    expected, got = ig(ids, edits=edits), program(ids, edits=edits)
    assert torch.equal(expected.logits, got.logits) and set(got.values) == set(values)
    assert all(torch.equal(expected[name], got[name]) for name in values)
    with pytest.raises(qgraph.EditError, match=r"\[1\] out of range for its seq axis of size 1"):
        ig(random_ids(1, 1))
    with pytest.raises(qgraph.EditError, match=r"the fixed edit Zero\(positions=\[1\]\) at layers.0.layer_output "
                                               r"needs dim 1 of its input to be at least 2"):  # asserted, not edited elsewhere
        program(random_ids(1, 1))
    fixed = qgraph.instrument(sdpa_model, values=["layers.2.layer_output"],
                              edits={"layers.2.mlp.mlp_neurons": lambda t: t * (2.0 if t.shape[1] == 7 else 1.0)})
    with pytest.raises(NotImplementedError, match=r"bad.qgraph cannot be saved: the fixed edit <function .*> at "
                                                  r"layers.2.mlp.mlp_neurons cannot be traced into the saved program"):
        fixed.save(tmp_path / "bad.qgraph")


def _with_graph(path, out, change):
    """A copy of the saved program at ``path`` whose graph.json is changed in place by ``change(data)``."""
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(out, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename == "graph.json":
                graph = json.loads(data)
                change(graph)
                data = json.dumps(graph).encode()
            target.writestr(item, data)
    return out


def test_a_file_runs_no_code_of_its_own(plain, sdpa_model, tmp_path):
    """Loading builds fx nodes from graph.json and calls only allow-listed ops: a graph that names
    another function (or an op outside aten, prims and qgraph), or whose node name, input name or
    attribute path is code (fx writes those into the code it generates), is refused by name, and
    nothing of it ran."""
    ran = tmp_path / "ran"
    code = f"__import__('pathlib').Path({str(ran)!r}).touch()"

    def first(op):
        return lambda data: next(n for n in data["graph"]["nodes"] if n["op"] == op)

    cases = [
        (first("call_function"), {"target": "builtins.exec", "args": [code]}, r"calls 'builtins.exec' \(node \w+\), "
                                                                               r"which is not on the positive list"),
        (first("call_function"), {"target": "os.system"}, "calls 'os.system'"),
        (first("call_function"), {"target": "torch.ops.aten.__class__.__init__"}, "calls 'torch.ops.aten.__class__"),
        (first("call_function"), {"target": "torch.ops.mylib.evil.default"}, "calls 'torch.ops.mylib.evil.default'"),
        (first("call_function"), {"name": f"x = {code}"}, "has a node named \"x = __import__"),
        (first("placeholder"), {"name": f"x=({code})"}, "has a node named"),
        (first("get_attr"), {"target": f"x; {code}"}, "reads \"x; __import__"),
    ]
    for index, (node, change, message) in enumerate(cases):
        bad = _with_graph(plain, tmp_path / f"bad{index}.qgraph", lambda data: node(data).update(change))
        with pytest.raises(qgraph.SavedProgramError, match=message):
            qgraph.load(bad, weights=sdpa_model)
    assert not ran.exists()


def test_weights_in_shards_with_an_index(saved, sdpa_model, tmp_path):
    """weights=True with a small max_shard_size: shards named as Hugging Face names them and their
    index, whose weight_map puts every tensor the program reads (tied ones once) in the shard that
    holds it; loaded from beside it, from the index or from the folder: the instrumented model's
    values bit for bit; without one of its shards, refused by the shard's name. Saved again in one
    file, the shards and index are gone."""
    ig, _ = saved
    path = qgraph.saved.save(ig, tmp_path / "probe.qgraph", weights=True, max_shard_size="100KB")
    index = tmp_path / "probe.safetensors.index.json"
    table = json.loads(index.read_text())
    files = sorted(tmp_path.glob("probe-*.safetensors"))
    assert [file.name for file in files] == [f"probe-{i:05d}-of-{len(files):05d}.safetensors"
                                             for i in range(1, len(files) + 1)] and len(files) > 2
    assert not (tmp_path / "probe.safetensors").exists() and not list(tmp_path.glob(".*"))  # no temporaries left
    meta = json.loads(zipfile.ZipFile(path).read("qgraph.json"))
    assert meta["weights"] == index.name
    assert set(table["weight_map"]) == set(meta["parameters"]) - {name for group in meta["tied"] for name in group[1:]}
    state, total = sdpa_model.state_dict(), 0
    for file in files:
        tensors = safetensors.torch.load_file(file)
        assert set(tensors) == {name for name, shard in table["weight_map"].items() if shard == file.name}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 100_000 or len(tensors) == 1
        assert all(torch.equal(tensor, state[name]) for name, tensor in tensors.items())  # bit for bit
        total += size
    assert table["metadata"]["total_size"] == total
    ids = random_ids(2, 9, seed=3)
    expected = ig(ids, edits=EDIT)
    for weights in (None, index, tmp_path):
        got = qgraph.load(path, weights=weights)(ids, edits=EDIT)
        assert torch.equal(expected.logits, got.logits) and all(torch.equal(expected[n], got[n]) for n in expected.values)
    files[1].rename(tmp_path / "away")
    with pytest.raises(qgraph.MissingFile, match=rf"probe.safetensors.index.json puts .* in {files[1].name}, which is "
                                                 rf"not in {tmp_path}: copy the shards the index names beside it"):
        qgraph.load(path)
    qgraph.saved.save(ig, path, weights=True)  # fits the default 5GB: one file
    assert sorted(file.name for file in tmp_path.iterdir()) == ["away", "probe.qgraph", "probe.safetensors"]
    assert torch.equal(qgraph.load(path)(ids, edits=EDIT).logits, expected.logits)
    with pytest.raises(ValueError, match="max_shard_size= takes a number of bytes or a size such as '5GB' or "
                                         "'500MiB', not '5 parsecs'"):
        qgraph.saved.save(ig, path, weights=True, max_shard_size="5 parsecs")


def test_a_program_saved_after_generate_serves_every_batch(sdpa_model, tmp_path):
    """Generation builds its programs beside the prompt program, from one export: the decode step's
    examples (of one batch) must not make the export's batch theirs, or a program saved (and an SAE
    spliced) after a generate would hold that batch. Saved after generating, the loaded program equals
    the instrumented model on batches of 1 and 3, and the HF forward."""
    from qgraph.saes import SAE
    from qgraph.saes.fixtures import write_saelens
    sae = SAE.load(write_saelens(tmp_path / "sae", d_in=64, d_sae=32, architecture="topk", k=4,
                                 hook_name="blocks.1.hook_resid_post", seed=3))
    ig = qgraph.instrument(sdpa_model, values=["layers.1.sae.features"], saes={"layers.1.layer_output": sae})
    ig.generate(random_ids(2, 4, seed=1), max_new_tokens=2)
    program = qgraph.load(ig.save(tmp_path / "after.qgraph"), weights=sdpa_model)
    for batch in (1, 3):
        ids = random_ids(batch, 5, seed=batch)
        expected, got = ig(ids), program(ids)
        assert torch.equal(expected.logits, got.logits) and torch.equal(expected["layers.1.sae.features"],
                                                                          got["layers.1.sae.features"])


def test_a_fixed_edit_past_the_call_is_an_edit_error(sdpa_model, tmp_path):
    """A fixed ``Zero(positions=[5])`` refuses a call of 3 tokens as the instrumented model does (an
    EditError naming the edit), and edits position 5 of a longer call as it does."""
    ig = qgraph.instrument(sdpa_model, values=["layers.2.layer_output"],
                           edits={"layers.1.layer_output": qgraph.Zero(positions=[5])})
    program = qgraph.load(ig.save(tmp_path / "zero5.qgraph"), weights=sdpa_model)
    with pytest.raises(qgraph.EditError):
        ig(random_ids(1, 3))
    with pytest.raises(qgraph.EditError, match=r"the fixed edit Zero\(positions=\[5\]\) at layers.1.layer_output needs "
                                               r"dim 1 of its input to be at least 6 .*; this call has 3 tokens"):
        program(random_ids(1, 3))
    ids = random_ids(2, 7, seed=5)
    assert torch.equal(ig(ids).logits, program(ids).logits)
    assert not torch.equal(ig(ids).logits, qgraph.instrument(sdpa_model, values=["layers.2.layer_output"])(ids).logits)


def test_a_glob_resolves_in_the_order_an_instrumented_model_resolves_it(sdpa_model, tmp_path):
    # values asked out of the program's order: the file's catalogue follows the program's order, not the asked one
    asked = ["layers.1.linear_attn.decays", "layers.0.linear_attn.betas", "layers.1.linear_attn.betas",
             "layers.0.linear_attn.decays"]
    ig = qgraph.instrument(sdpa_model, values=asked)
    loaded = qgraph.load(ig.save(tmp_path / "ordered.qgraph"), weights=sdpa_model)
    for pattern in ("layers.*.linear_attn.*", ["layers.1.linear_attn.*", "layers.0.linear_attn.*"]):
        local = [name for name in ig.resolve(pattern) if name in asked]
        assert local != asked and loaded.resolve(pattern) == local
