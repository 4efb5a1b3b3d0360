"""SAEs spliced into the program (issue 15): their values against the SAE's own math and the model's
forward, feature edits, the reconstruction splice, reading top features, and what is refused."""
from __future__ import annotations

import pytest
import torch

import qgraph
from conftest import hf_logits
from qgraph.capture import CaptureMismatch
from qgraph.saes import SAE
from qgraph.saes.fixtures import write_saelens

HOOK = "layers.1.layer_output"
VALUES = [HOOK, "layers.2.layer_input", "layers.1.sae.features", "layers.1.sae.reconstruction", "layers.1.sae.error"]


@pytest.fixture(scope="module")
def sae(sdpa_model, tmp_path_factory):
    path = write_saelens(tmp_path_factory.mktemp("sae"), d_in=sdpa_model.config.hidden_size, d_sae=256,
                         architecture="topk", k=8, hook_name="blocks.1.hook_resid_post", seed=1)
    return SAE.load(path)


@pytest.fixture(scope="module")
def spliced(sdpa_model, sae):
    return qgraph.instrument(sdpa_model, values=VALUES, edits=["layers.1.sae.features"], saes={HOOK: sae})


@pytest.fixture(scope="module")
def run(spliced, ids):
    return spliced(ids)


def test_the_values_are_the_saes_math_and_the_logits_the_models(sdpa_model, sae, ids, run):
    x = run[HOOK]
    torch.testing.assert_close(run.logits, hf_logits(sdpa_model, ids), rtol=0, atol=0)  # the error term is kept
    torch.testing.assert_close(run["layers.1.sae.features"], sae.encode(x), rtol=0, atol=1e-6)
    assert ((run["layers.1.sae.features"] != 0).sum(-1) <= sae.k).all()
    torch.testing.assert_close(run["layers.1.sae.reconstruction"], sae.decode(sae.encode(x)), rtol=0, atol=1e-6)
    torch.testing.assert_close(run["layers.1.sae.error"], x - sae.decode(sae.encode(x)), rtol=0, atol=1e-6)
    assert torch.equal(run["layers.2.layer_input"], x)


def test_zeroing_every_feature_leaves_the_error_and_b_dec(spliced, sae, ids, run):
    out = spliced(ids, edits={"layers.1.sae.features": qgraph.Zero()})
    assert torch.equal(out["layers.1.sae.features"], torch.zeros_like(run["layers.1.sae.features"]))
    torch.testing.assert_close(out["layers.2.layer_input"], out["layers.1.sae.error"] + sae.b_dec, rtol=0, atol=1e-6)
    assert not torch.allclose(out.logits, run.logits)


def test_a_feature_edit_moves_the_stream_by_the_decoded_change(spliced, sae, ids, run):
    active = int(run["layers.1.sae.features"][0, -1].argmax())
    out = spliced(ids, edits={"layers.1.sae.features": qgraph.Scale(3.0, neurons=[active])})
    features = run["layers.1.sae.features"].clone()
    features[..., active] *= 3.0
    assert torch.equal(out["layers.1.sae.features"], features)
    moved = run[HOOK] + (sae.decode(features) - sae.decode(run["layers.1.sae.features"]))
    torch.testing.assert_close(out["layers.2.layer_input"], moved, rtol=0, atol=1e-5)
    torch.testing.assert_close(out["layers.1.sae.reconstruction"], sae.decode(features), rtol=0, atol=1e-6)


def test_steering_along_a_features_direction(spliced, sae, ids, run):
    steer = qgraph.steer(2, sae.direction(5), 4.0)
    out = spliced(ids, edits=steer)
    assert torch.equal(sae.direction(5), sae.W_dec[5])
    assert torch.equal(out.logits, qgraph.instrument(spliced.model, edits=steer)(ids).logits)  # the SAE changes nothing
    assert not torch.allclose(out.logits, run.logits)


def test_the_reconstruction_splice_feeds_the_reconstruction(sdpa_model, sae, ids, run):
    ig = qgraph.instrument(sdpa_model, values=["layers.2.layer_input", "layers.1.sae.reconstruction"],
                           saes={HOOK: sae}, splice="reconstruction")
    out = ig(ids)
    assert torch.equal(out["layers.2.layer_input"], out["layers.1.sae.reconstruction"])
    torch.testing.assert_close(out["layers.1.sae.reconstruction"], run["layers.1.sae.reconstruction"], rtol=0, atol=1e-6)
    assert not torch.allclose(out.logits, run.logits)


def test_top_features_are_the_largest_activations(spliced, sae, ids, run):
    activations, features = spliced.top_features(ids, layer=1, k=3)
    expected = run["layers.1.sae.features"].topk(3, dim=-1)
    assert torch.equal(activations, expected.values) and torch.equal(features, expected.indices)
    reader = qgraph.instrument(spliced.model, saes={HOOK: sae})  # it does not capture the features itself
    assert torch.equal(reader.top_features(ids, 1, 3)[1], features)


def test_the_block_diagram_draws_the_sae(spliced):
    from qgraph.render import diagram as draw
    boxes = draw(spliced, "block", 1).boxes.values()
    labels = " ".join(box.label for box in boxes)
    assert "features" in labels and "error" in labels and "encode" in labels


def test_what_is_refused_says_why(sdpa_model, sae, tmp_path, ids):
    narrow = SAE.load(write_saelens(tmp_path / "narrow", d_in=32, d_sae=64, architecture="standard",
                                    hook_name="blocks.1.hook_resid_post"))
    with pytest.raises(ValueError, match="reads vectors of 32 but 'layers.1.layer_output' has 64"):
        qgraph.instrument(sdpa_model, saes={HOOK: narrow})
    with pytest.raises(ValueError, match="selects 4 values"):
        qgraph.instrument(sdpa_model, saes={"layers.*.layer_output": sae})
    with pytest.raises(ValueError, match="splice='everything'"):
        qgraph.instrument(sdpa_model, saes={HOOK: sae}, splice="everything")
    with pytest.raises(TypeError, match="not an SAE"):
        qgraph.instrument(sdpa_model, saes={HOOK: torch.nn.Linear(64, 64)})
    with pytest.raises(ValueError, match="no SAE is spliced at block 2"):
        qgraph.instrument(sdpa_model, saes={HOOK: sae}).top_features(ids, 2)
    with pytest.raises(qgraph.EditError, match="read-only"):
        qgraph.instrument(sdpa_model, saes={HOOK: sae}, edits=["layers.1.sae.error"])


def test_the_sparse_form_is_the_features_k_largest(sdpa_model, sae, ids):
    ig = qgraph.instrument(sdpa_model, values=["layers.1.sae.*"], edits=["layers.1.sae.features"], saes={HOOK: sae})
    for edits in ({}, {"layers.1.sae.features": qgraph.Scale(0.0, neurons=[3, 7])}):
        out = ig(ids, edits=edits)
        features, activations, indices = (out[f"layers.1.sae.{part}"] for part in ("features", "activations", "indices"))
        assert indices.dtype == torch.int32 and activations.shape == (*ids.shape, sae.k)
        assert torch.equal(activations, features.topk(sae.k, dim=-1).values)
        assert torch.equal(torch.zeros_like(features).scatter(-1, indices.long(), activations), features)
    assert ig.catalogue["layers.1.sae.indices"].layout == "Features [batch seq k]"


def test_a_jumprelu_sae_has_no_sparse_form(sdpa_model, tmp_path, ids):
    jump = SAE.load(write_saelens(tmp_path, d_in=64, d_sae=128, architecture="jumprelu",
                                  hook_name="blocks.1.hook_resid_post", seed=2))
    ig = qgraph.instrument(sdpa_model, values=["layers.1.sae.*"], saes={HOOK: jump})
    assert ig.values == ["layers.1.sae.features", "layers.1.sae.reconstruction", "layers.1.sae.error"]
    out = ig(ids)
    torch.testing.assert_close(out["layers.1.sae.features"], jump.encode(out["layers.1.sae.error"]
                                                                          + out["layers.1.sae.reconstruction"]),
                               rtol=0, atol=1e-5)
    with pytest.raises(qgraph.UnavailableValue, match="a TopK SAE's .* is jumprelu: read 'layers.1.sae.features'"):
        qgraph.instrument(sdpa_model, values=["layers.1.sae.indices"], saes={HOOK: jump})


def test_the_reconstruction_splice_equals_a_forward_hook_with_gradients(checkpoint, sae, ids):
    """``splice="reconstruction"`` against the HF model with a forward hook that replaces the block's
    output by ``sae(x)``: same logits, same gradients of the model's weights."""
    from transformers import AutoModelForCausalLM
    hooked, spliced = (AutoModelForCausalLM.from_pretrained(checkpoint) for _ in range(2))

    def replace(module, args, output):
        return sae(output) if isinstance(output, torch.Tensor) else (sae(output[0]), *output[1:])

    handle = hooked.model.layers[1].register_forward_hook(replace)
    expected = hooked(input_ids=ids).logits
    expected.square().mean().backward()
    handle.remove()
    ig = qgraph.instrument(spliced, saes={HOOK: sae}, splice="reconstruction")
    logits = ig(ids).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    logits.square().mean().backward()
    for (name, mine), (_, theirs) in zip(spliced.named_parameters(), hooked.named_parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert sae.W_enc.grad is None  # the SAE is read, not trained


def test_compiled_features_equal_eager(spliced, ids, run):
    out = spliced.compile()(ids)
    torch.testing.assert_close(out["layers.1.sae.features"], run["layers.1.sae.features"], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.logits, run.logits, rtol=0, atol=1e-5)


def test_an_sae_of_another_value_is_refused(sdpa_model, sae):
    with pytest.raises(ValueError, match="trained on 'layers.1.layer_output', not 'layers.2.layer_output'"):
        qgraph.instrument(sdpa_model, saes={"layers.2.layer_output": sae})


def test_capture_writes_the_sparse_features(sdpa_model, tokenizer, sae, tmp_path):
    texts = [f"text {i} " * (i + 2) for i in range(5)]
    values = ["layers.1.sae.activations", "layers.1.sae.indices"]
    setup = dict(context=16, batch_size=2, dtype=torch.float32, progress=False)
    run = qgraph.capture(sdpa_model, tokenizer, texts, values, tmp_path / "acts", saes={HOOK: sae}, **setup)
    data = qgraph.load_capture(tmp_path / "acts")
    ids, mask = data.values("input_ids"), data.values("attention_mask")
    out = qgraph.instrument(sdpa_model, values=values, saes={HOOK: sae})(ids, mask)
    assert data.values("layers.1.sae.indices").dtype == torch.int32 and run.rows == ids.shape[0] > 1
    assert torch.equal(data.values("layers.1.sae.indices"), out["layers.1.sae.indices"])
    torch.testing.assert_close(data.values("layers.1.sae.activations"), out["layers.1.sae.activations"],
                               rtol=0, atol=1e-6)  # batched 2 rows at a time there, all rows here
    other = SAE.load(write_saelens(tmp_path / "other", d_in=64, d_sae=256, architecture="topk", k=8,
                                   hook_name="blocks.1.hook_resid_post", seed=3))
    with pytest.raises(CaptureMismatch, match="saes"):
        qgraph.capture(sdpa_model, tokenizer, texts, values, tmp_path / "acts", saes={HOOK: other}, **setup)


def test_the_command_line_captures_an_saes_features(checkpoint, sdpa_model, sae, tmp_path, capsys):
    from qgraph.cli import main
    data = tmp_path / "texts.txt"
    data.write_text("one line of text\nand another one\n")
    sae_dir = write_saelens(tmp_path / "sae", d_in=64, d_sae=256, architecture="topk", k=8,
                            hook_name="blocks.1.hook_resid_post", seed=1)
    common = ["capture", "--model", str(checkpoint), "--data", str(data), "--context", "16", "--batch-size", "2",
              "--dtype", "float32", "--values", "layers.1.sae.indices", "--out"]
    assert main([*common, str(tmp_path / "acts"), "--sae", f"{HOOK}={sae_dir}"]) == 0
    cap = qgraph.load_capture(tmp_path / "acts")
    ids, mask = cap.values("input_ids"), cap.values("attention_mask")
    expected = qgraph.instrument(sdpa_model, values=["layers.1.sae.indices"], saes={HOOK: sae})(ids, mask)
    assert torch.equal(cap.values("layers.1.sae.indices"), expected["layers.1.sae.indices"])
    assert main([*common, str(tmp_path / "other"), "--sae", f"layers.2.layer_output={sae_dir}"]) == 2
    assert "is the SAE of layer 1 (layers.1.layer_output), not layer=2" in capsys.readouterr().err
    assert main([*common, str(tmp_path / "other"), "--sae", "layers.1.layer_output"]) == 2
    assert "give VALUE=PATH" in capsys.readouterr().err
