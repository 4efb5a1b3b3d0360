"""The disk cache of exported programs: a second process (here: a second model object) loads the
program instead of exporting, gets identical values, and a broken file falls back to exporting."""
from __future__ import annotations

import json
import re

import pytest
import torch

import qgraph
from qgraph.export import disk_cache as cache, stored
from qgraph.kernels.ops import MARK_OP
from qgraph.export.repeat import repeated_blocks
from conftest import hf_logits, random_ids, stored_round_trip

VALUES = ["layers.*.layer_output", "layers.0.linear_attn.*", "layers.3.self_attn.attention_probabilities",
          "layers.2.mlp.down_proj.input"]


@pytest.fixture
def disk_cache(tmp_path, monkeypatch):
    """The disk cache turned on, in a fresh directory; counts the exports that really run."""
    monkeypatch.setenv("QGRAPH_CACHE", str(tmp_path))
    monkeypatch.setenv("QGRAPH_PROGRAM_CACHE", "1")
    from qgraph import compat
    compat.export_dims({})  # its once-a-process probe of torch's solver (an export of its own) runs first
    exports = []
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: exports.append(1) or export(*args, **kwargs))
    return exports


def _load(checkpoint):
    """A fresh model object: export_model's in-memory cache has never seen it."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


@pytest.mark.compat
def test_second_model_object_loads_the_program_and_gives_identical_values(checkpoint, disk_cache):
    ids = random_ids(2, 70, seed=5)
    first = qgraph.instrument(_load(checkpoint), values=VALUES, edits=["layers.1.layer_output"])
    assert disk_cache == [1] and not first.exported.from_cache
    files = list(cache.directory().glob("*.json"))
    assert [f.name for f in files] == [cache.path_for(first.model, False).name]

    second = qgraph.instrument(_load(checkpoint), values=VALUES, edits=["layers.1.layer_output"])
    assert disk_cache == [1], "the second instrument exported again"
    assert second.exported.from_cache
    with torch.no_grad():
        a, b = first(ids), second(ids)
        assert torch.equal(a.logits, b.logits)
        assert a.values.keys() == b.values.keys() and all(torch.equal(a[name], b[name]) for name in a.values)
        edit = {"layers.1.layer_output": lambda x: x + 1}
        assert torch.equal(first(ids, edits=edit).logits, second(ids, edits=edit).logits)

    # what the locator reads survived the round trip: the markers' port names and module scopes
    def marks(program):
        return [(node.args[1], list(node.meta["nn_module_stack"].values())[-1][0])
                for node in program.graph.nodes if node.target is MARK_OP]
    assert marks(second.exported.program) == marks(first.exported.program) != []
    assert second.catalogue.keys() == first.catalogue.keys()
    assert [e.available for e in second.catalogue.values()] == [e.available for e in first.catalogue.values()]

    # no weight was written: each state_dict entry is a placeholder of the right shape and dtype
    # with one element of storage (the program reads the model's own parameters at call time)
    # The file holds the seed export (qgraph.export.repeat): its layer list is the first block of each kind.
    recorded = json.loads(files[0].read_text())
    placeholders = stored.program_from_data(recorded["program"], {}).state_dict
    seed = repeated_blocks(first.model, first.family, images=False)[0].seed
    real_names = {re.sub(r"^model\.layers\.(\d+)\.", lambda m: f"model.layers.{seed[int(m[1])]}.", name): placeholder
                  for name, placeholder in placeholders.items()}
    assert real_names and real_names.keys() <= first.model.state_dict().keys()
    for name, placeholder in real_names.items():
        parameter = first.model.get_parameter(name)
        assert placeholder.shape == parameter.shape and placeholder.dtype == parameter.dtype
        assert placeholder.untyped_storage().nbytes() <= placeholder.element_size()


@pytest.mark.compat
def test_a_block_unlike_its_seed_loads_from_the_cache_still_apart(checkpoint, disk_cache):
    def unlike(model):
        model.model.layers[2].linear_attn.norm.variance_epsilon = 1.0  # block 0 is the DeltaNet blocks' seed
        return model
    first = qgraph.instrument(unlike(_load(checkpoint)))
    assert disk_cache == [1, 1]  # the second trace holds block 2 apart (qgraph.export.variants)
    second = qgraph.instrument(unlike(_load(checkpoint)))
    assert disk_cache == [1, 1] and second.exported.from_cache
    assert second.exported.apart == first.exported.apart and len(first.exported.apart) == 1
    ids = random_ids(2, 20, seed=6)
    with torch.no_grad():
        torch.testing.assert_close(second(ids).logits, hf_logits(second.model, ids), atol=1e-5, rtol=0)


def test_a_corrupt_file_falls_back_to_exporting_and_is_overwritten(checkpoint, disk_cache):
    model = _load(checkpoint)
    path = cache.path_for(model, False)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a program")
    with pytest.warns(UserWarning, match="ignoring the cached program"):
        ig = qgraph.instrument(model, values=["layers.0.layer_output"])
    assert disk_cache == [1] and not ig.exported.from_cache
    assert json.loads(path.read_bytes())["program"]["nodes"]  # overwritten by a good one
    ids = random_ids(1, 5)
    with torch.no_grad():
        torch.testing.assert_close(ig(ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_the_key_follows_what_the_program_is_specialised_on(checkpoint, sdpa_model, eager_model):
    a, b = _load(checkpoint), _load(checkpoint)
    assert cache.key(a, False) == cache.key(b, False) == cache.key(sdpa_model, False)  # same checkpoint
    assert cache.key(a, False) != cache.key(eager_model, False)  # attn implementation
    assert cache.key(a, False) != cache.key(a, True)  # images flag
    assert cache.key(a, False) != cache.key(b.to(torch.float64), False)  # dtype


def test_the_cache_can_be_turned_off(sdpa_model, disk_cache, monkeypatch):
    monkeypatch.setenv("QGRAPH_PROGRAM_CACHE", "0")
    assert cache.save(sdpa_model, False, program=None) is None
    assert cache.load(sdpa_model, False, ("input_ids", "attention_mask")) is None
    assert not cache.directory().exists()


def test_the_cache_format_round_trips_the_program_node_for_node(ig):
    """Every node, scope, value (sizes as expressions), the signature and ranges survive the file
    (``qgraph.export.stored``; the MoE families and the image-text program: tests/test_moe.py)."""
    stored_round_trip(ig.exported.program)
