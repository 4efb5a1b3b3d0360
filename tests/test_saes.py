"""SAEs spliced into the program (issue 15): their values against the SAE's own math and the model's
forward, feature edits, the reconstruction splice, reading top features, and what is refused."""
from __future__ import annotations

import pytest
import torch

import qgraph
from conftest import hf_logits, hooked_blocks
from qgraph.capture import CaptureMismatch
from qgraph.saes import SAE
from qgraph.saes.fixtures import weights, write_saelens

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


@pytest.mark.parametrize("splice", ["error", "reconstruction"])
def test_the_splice_is_its_formulas_bit_for_bit(sdpa_model, sae, ids, splice):
    """What block 2 reads and the SAE's values, exactly, against the SAE's own decode of the features
    the graph made: ``error = x - decode(features0)``; with ``splice="error"`` block 2 reads ``x``
    unedited and ``x + (decode(features) - decode(features0))`` edited; with ``"reconstruction"``,
    ``decode(features)``."""
    ig = qgraph.instrument(sdpa_model, values=VALUES, edits=["layers.1.sae.features"], saes={HOOK: sae}, splice=splice)
    plain = ig(ids)
    features0 = plain["layers.1.sae.features"]
    active = int(features0[0, -1].argmax())
    for out in (plain, ig(ids, edits={"layers.1.sae.features": qgraph.Scale(3.0, neurons=[active])})):
        x, features = out[HOOK], out["layers.1.sae.features"]
        assert torch.equal(x, plain[HOOK])  # the value itself stays the model's
        assert torch.equal(out["layers.1.sae.error"], x - sae.decode(features0))
        assert torch.equal(out["layers.1.sae.reconstruction"], sae.decode(features))
        reads = x + (sae.decode(features) - sae.decode(features0)) if out is not plain else x
        assert torch.equal(out["layers.2.layer_input"], sae.decode(features) if splice == "reconstruction" else reads)
    assert not torch.equal(features, features0)


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
    w = weights(64, 128)
    plain = SAE(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], "relu")  # reads any value
    with pytest.raises(ValueError, match="'layers.1.mlp.mlp_output' and 'layers.1.mlp.output' are one tensor"):
        qgraph.instrument(sdpa_model, saes={"layers.1.mlp.mlp_output": plain, "layers.1.mlp.output": plain})


def test_the_sparse_form_is_the_edited_features_the_encoder_selected(sdpa_model, sae, ids):
    ig = qgraph.instrument(sdpa_model, values=["layers.1.sae.*"], edits=["layers.1.sae.features"], saes={HOOK: sae})
    run = ig(ids)
    selected = run["layers.1.sae.indices"]
    zeroed = [int(selected[0, -1, 0]), int(selected[1, 3, 2])]
    for out in (run, ig(ids, edits={"layers.1.sae.features": qgraph.Scale(0.0, neurons=zeroed)})):
        features, activations, indices = (out[f"layers.1.sae.{part}"] for part in ("features", "activations", "indices"))
        assert indices.dtype == torch.int32 and activations.shape == (*ids.shape, sae.k)
        assert torch.equal(indices, selected)  # an edit changes the values, not the encoder's selection
        assert torch.equal(activations, features.gather(-1, indices.long()))
        assert torch.equal(torch.zeros_like(features).scatter(-1, indices.long(), activations), features)
    assert (out["layers.1.sae.activations"][0, -1, 0] == 0) and (run["layers.1.sae.activations"][0, -1, 0] > 0)
    assert ig.catalogue["layers.1.sae.indices"].layout == "Features [batch seq k]"


def hf_block_output(model, ids, block):
    """The output of decoder layer ``block`` in the plain Hugging Face forward (a forward hook)."""
    seen = []
    handle = model.model.layers[block].register_forward_hook(
        lambda module, args, output: seen.append(output if isinstance(output, torch.Tensor) else output[0]))
    hf_logits(model, ids)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize("form", ["topk", "raw topk", "jumprelu", "relu"])
def test_the_sparse_form_is_the_encoders_own_selection(sdpa_model, ids, form):
    """Against the plain math on the SAE's weights and the HF model's block output: TopK's indices
    are ``topk(pre)``'s, also where selected pre-activations are negative (a raw value below the
    unselected zeros, a relu'd one equal to them); JumpReLU and ReLU SAEs have dense features only."""
    w = weights(64, 256, seed=5)
    activation, topk_relu = {"raw topk": ("topk", False), "topk": ("topk", True)}.get(form, (form, True))
    if activation == "topk":  # 3 features are selected positive, the other 5 of each token negative
        w["b_enc"] = torch.cat([torch.full((3,), 20.0), torch.full((253,), -20.0)]) + w["b_enc"]
    sae = SAE(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], activation, k=8 if activation == "topk" else None,
              threshold=w["threshold"] if activation == "jumprelu" else None, topk_relu=topk_relu, hook=HOOK)
    x = hf_block_output(sdpa_model, ids, 1)
    pre = x @ w["W_enc"] + w["b_enc"]
    ig = qgraph.instrument(sdpa_model, values=["layers.1.sae.*"], saes={HOOK: sae})
    out = ig(ids)
    if activation == "topk":
        values, indices = pre.topk(8, dim=-1)
        assert (values[..., 3:] < 0).all() and (values[..., :3] > 0).all()
        activations = torch.relu(values) if topk_relu else values
        assert torch.equal(out["layers.1.sae.indices"], indices.int())
        torch.testing.assert_close(out["layers.1.sae.activations"], activations, rtol=0, atol=1e-5)
        features = torch.zeros_like(pre).scatter(-1, indices, activations)
    else:
        features = torch.relu(pre) * (pre > w["threshold"]) if activation == "jumprelu" else torch.relu(pre)
        assert ig.values == ["layers.1.sae.features", "layers.1.sae.reconstruction", "layers.1.sae.error"]
    torch.testing.assert_close(out["layers.1.sae.features"], features, rtol=0, atol=1e-5)


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


def test_two_saes_at_one_block_each_splice_under_their_own_names(checkpoint, sae, tmp_path, ids):
    """SAEs at block 1's input and output (SAELens's resid_pre and resid_post): with
    ``splice="reconstruction"`` the logits are the HF model's with forward hooks replacing both values
    by their reconstructions; each SAE's values are under its value's name, the short ones refused."""
    from transformers import AutoModelForCausalLM

    from qgraph.saes.read import top_features
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    first = SAE.load(write_saelens(tmp_path, d_in=64, d_sae=128, architecture="standard",
                                   hook_name="blocks.1.hook_resid_pre", seed=4))
    block, seen = model.model.layers[1], {}

    def replace_input(module, args):
        seen["layers.1.layer_input"] = args[0]
        return (first(args[0]), *args[1:])

    def replace_output(module, args, output):
        seen[HOOK] = output if isinstance(output, torch.Tensor) else output[0]
        return sae(output) if isinstance(output, torch.Tensor) else (sae(output[0]), *output[1:])

    handles = [block.register_forward_pre_hook(replace_input), block.register_forward_hook(replace_output)]
    expected = hf_logits(model, ids)
    for handle in handles:
        handle.remove()
    both = {"layers.1.layer_input": first, HOOK: sae}
    names = [f"{hook}.sae.features" for hook in both]
    ig = qgraph.instrument(model, values=["layers.1.*.sae.features"], saes=both, splice="reconstruction")
    assert ig.values == names
    out = ig(ids)
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=1e-5)
    only_output = qgraph.instrument(model, saes={HOOK: sae}, splice="reconstruction")(ids).logits
    assert not torch.allclose(out.logits, only_output, atol=1e-3)
    for hook, name in zip(both, names):
        torch.testing.assert_close(out[name], both[hook].encode(seen[hook]), rtol=0, atol=1e-5)
    # the short names are no one's; top_features picks by block and value, with the other SAE spliced
    for ask in ("layers.1.sae.features", "layers.1.sae.*"):
        with pytest.raises(qgraph.UnavailableValue, match=r"SAEs read 2 values of 'layers.1' \(layers.1.layer_input, "
                                                          r"layers.1.layer_output\): name one"):
            qgraph.instrument(model, values=[ask], saes=both)
    with pytest.raises(ValueError, match="block 1 has 2 SAEs .* pick one with value="):
        ig.top_features(ids, layer=1)
    reader = qgraph.instrument(model, saes=both, splice="reconstruction")  # it reads through a twin
    activations, features = top_features(reader, ids, layer=1, k=3, value=HOOK)
    top = sae.encode(seen[HOOK]).topk(3, dim=-1)
    assert torch.equal(features, top.indices)
    torch.testing.assert_close(activations, top.values, rtol=0, atol=1e-5)
    assert torch.equal(top_features(ig, ids, value="layers.1.layer_input", k=3)[1], out[names[0]].topk(3).indices)


def test_the_one_sae_of_a_block_answers_to_both_names(sdpa_model, run, sae, ids):
    """``layers.1.sae.*`` and ``layers.1.layer_output.sae.*`` name one SAE's values, edits included."""
    active = int(run["layers.1.sae.features"][0, -1].argmax())
    for name in ("layers.1.layer_output.sae.features", "layers.1.sae.features"):  # an edit under either name
        ig = qgraph.instrument(sdpa_model, values=["layers.1.layer_output.sae.*", "layers.1.sae.features"],
                               edits=[name], saes={HOOK: sae})
        out = ig(ids, edits={name: qgraph.Zero(neurons=[active])})
        assert torch.equal(out["layers.1.sae.features"], out["layers.1.layer_output.sae.features"])
        assert (out["layers.1.sae.features"][..., active] == 0).all()
        assert not torch.equal(out["layers.1.layer_output.sae.reconstruction"], run["layers.1.sae.reconstruction"])
    with pytest.raises(qgraph.EditError, match="are one tensor: edit it under one name"):
        ig(ids, edits={"layers.1.layer_output.sae.features": qgraph.Zero()})


@pytest.mark.slow  # it compiles with inductor: the slow tier
def test_compiled_features_equal_eager(sdpa_model, sae, ids, run):
    # dynamo + AOTAutograd over the SAE's nodes; inductor's codegen is tested in test_compile
    compiled = qgraph.instrument(sdpa_model, values=VALUES, saes={HOOK: sae}, compile={"backend": "aot_eager"})
    out = compiled(ids)
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


def test_patching_and_top_features_run_with_the_instruments_saes_and_fixed_edits(sdpa_model, sae, ids):
    """qgraph.patch at an SAE's features, and top_features under a fixed steering edit, equal HF
    forward hooks doing the SAE's math by hand."""
    vector = torch.randn(sdpa_model.config.hidden_size, generator=torch.Generator().manual_seed(2)) * 3
    ig = qgraph.instrument(sdpa_model, saes={HOOK: sae}, edits=qgraph.steer(0, vector))
    steer = {0: lambda out: out + vector}
    clean, corrupt = ids, ids.flip(0)
    _, clean_blocks = hooked_blocks(sdpa_model, clean, {**steer, 1: lambda out: out})
    clean_features = sae.encode(clean_blocks[1])

    def patched_block(out):  # the stream moves by the decoded change of the features
        return out + sae.decode(clean_features) - sae.decode(sae.encode(out))
    reference, _ = hooked_blocks(sdpa_model, corrupt, {**steer, 1: patched_block})
    patched = qgraph.patch(ig, clean, corrupt, at=["layers.1.sae.features"], metric=lambda logits: logits)
    torch.testing.assert_close(patched["layers.1.sae.features"], reference, rtol=0, atol=1e-5)

    activations, features = ig.top_features(clean, layer=1, k=4)
    want = clean_features.topk(4, dim=-1)
    torch.testing.assert_close(activations, want.values, rtol=0, atol=1e-5)
    assert torch.equal(features, want.indices)
    unsteered = sae.encode(hooked_blocks(sdpa_model, clean, {1: lambda out: out})[1][1]).topk(4, dim=-1)
    assert not torch.equal(features, unsteered.indices)  # the fixed edit matters here
