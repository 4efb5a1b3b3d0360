"""Per-layer transcoders: circuit-tracer's and SAELens's files loaded into one record (against the
tensors written and plain math on them), spliced across a block's MLP (against the HF forward with a
hook on that MLP), feature edits, the reconstruction splice, the MoE block, and what is refused."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

import qgraph
from conftest import hf_logits, random_ids
from qgraph import Transcoder
from qgraph.testing import write_saelens, write_transcoders

PARTS = ("features", "error", "reconstruction")
RECORD = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")


def names(block: int, parts=PARTS) -> list[str]:
    return [f"layers.{block}.transcoder.{part}" for part in parts]


def hooked_mlp(model, ids, block: int, change=None):
    """The HF forward with a forward hook on block ``block``'s MLP: ``(logits, the MLP's input, its
    output)``; ``change(input, output)`` (when given) is what the model reads instead of the output."""
    seen = {}

    def hook(module, args, output):
        seen["input"], seen["output"] = args[0], output
        return None if change is None else change(args[0], output)

    handle = model.model.layers[block].mlp.register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        handle.remove()
    return logits, seen["input"], seen["output"]


# -- loading -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation, skip", [("relu", False), ("jumprelu", False), ("relu", True), ("jumprelu", True)])
def test_both_formats_load_the_tensors_written_in_one_convention(tmp_path, activation, skip):
    ct = write_transcoders(tmp_path / "ct", 16, 2, 32, activation=activation, skip=skip, seed=4)
    sl = write_transcoders(tmp_path / "sl", 16, 2, 32, format="saelens", activation=activation, skip=skip, seed=4)
    a, b = Transcoder.load(ct, layer=1), Transcoder.load(sl, layer=1)
    # circuit-tracer's layer_1.safetensors: W_enc and W_dec [d_transcoder, d_model], W_skip [d_model, d_model]
    file = load_file(str(ct / "layer_1.safetensors"))
    assert sorted(file) == sorted(["W_enc", "W_dec", "b_enc", "b_dec"] + ["activation_function.threshold"] *
                                  (activation == "jumprelu") + ["W_skip"] * skip)
    assert file["W_enc"].shape == file["W_dec"].shape == (32, 16)
    assert torch.equal(a.W_enc, file["W_enc"].T) and torch.equal(a.W_dec, file["W_dec"])
    assert torch.equal(a.b_enc, file["b_enc"]) and torch.equal(a.b_dec, file["b_dec"])
    # SAELens's layer_1/sae_weights.safetensors: W_enc [d_in, d_sae], W_dec [d_sae, d_out], W_skip [d_out, d_in]
    weights = load_file(str(sl / "layer_1" / "sae_weights.safetensors"))
    assert torch.equal(b.W_enc, weights["W_enc"]) and torch.equal(b.W_dec, weights["W_dec"])
    if activation == "jumprelu":
        assert torch.equal(a.threshold, file["activation_function.threshold"])
        assert torch.equal(b.threshold, weights["threshold"])
    if skip:
        assert torch.equal(a.W_skip, file["W_skip"].T) and torch.equal(b.W_skip, weights["W_skip"].T)
        assert not torch.equal(file["W_skip"], file["W_skip"].T)  # the transpose is seen
    else:
        assert a.W_skip is None and b.W_skip is None
    for name in RECORD:  # one seed: the same record from both formats, tensor for tensor
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), name
    assert (a.layer, a.reads, a.activation, a.d_in, a.d_sae, a.d_out) == (1, "mlp_input", activation, 16, 32, 16)
    assert (b.layer, b.reads, b.activation, b.d_in, b.d_sae, b.d_out) == (1, "mlp_input", activation, 16, 32, 16)
    config = yaml.safe_load((ct / "config.yaml").read_text())
    assert (config["model_kind"], config["feature_input_hook"], config["feature_output_hook"]) == \
        ("transcoder_set", "mlp.hook_in", "mlp.hook_out")
    cfg = json.loads((sl / "layer_1" / "cfg.json").read_text())
    assert cfg["architecture"] == ("jumprelu_" if activation == "jumprelu" else "") + \
        ("skip_transcoder" if skip else "transcoder")
    assert (cfg["d_in"], cfg["d_sae"], cfg["d_out"], cfg["apply_b_dec_to_input"]) == (16, 32, 16, False)
    assert cfg["metadata"]["hook_name"] == "blocks.1.ln2.hook_normalized"
    assert Transcoder.load(sl / "layer_0").layer == 0 and Transcoder.load(ct / "layer_0.safetensors").layer == 0


def test_the_hooks_are_read_with_the_familys_table(tmp_path):
    """Every hook name of the MLP's input the family's table has loads (block-less in config.yaml, with
    the block in SAELens's cfg.json); any other is refused with the ones qgraph splices at."""
    ct, sl = write_transcoders(tmp_path / "ct", 16, 2, 32), write_transcoders(tmp_path / "sl", 16, 2, 32, format="saelens")
    config = yaml.safe_load((ct / "config.yaml").read_text())
    cfg = json.loads((sl / "layer_1" / "cfg.json").read_text())
    for hook, reads in [("mlp.hook_in", "mlp_input"), ("ln2.hook_normalized", "mlp_input"),
                        ("hook_resid_mid", "layer_mid"), ("hook_mlp_in", "layer_mid")]:
        (ct / "config.yaml").write_text(yaml.safe_dump({**config, "feature_input_hook": hook}))
        (sl / "layer_1" / "cfg.json").write_text(json.dumps({**cfg, "metadata": {
            **cfg["metadata"], "hook_name": f"blocks.1.{hook}", "hook_name_out": "blocks.1.mlp.hook_out"}}))
        assert Transcoder.load(ct, layer=1).reads == reads and Transcoder.load(sl / "layer_1").reads == reads
    (ct / "config.yaml").write_text(yaml.safe_dump({**config, "feature_input_hook": "hook_resid_pre"}))
    with pytest.raises(qgraph.NotSupported, match=r"reads 'hook_resid_pre'; qgraph splices transcoders that read a "
                                                  r"block's MLP input \(ln2.hook_normalized, mlp.hook_in, "
                                                  r"hook_resid_mid, hook_mlp_in\)"):
        Transcoder.load(ct, layer=1)
    (ct / "config.yaml").write_text(yaml.safe_dump({**config, "feature_output_hook": "hook_resid_post"}))
    with pytest.raises(qgraph.NotSupported, match=r"MLP output \(hook_mlp_out, mlp.hook_out\)"):
        Transcoder.load(ct, layer=1)


@pytest.mark.parametrize("activation", ["relu", "jumprelu", "topk"])
def test_encode_decode_and_skip_are_the_plain_math_on_the_files(tmp_path, activation):
    folder = write_transcoders(tmp_path, 16, 1, 64, activation=activation, skip=True, seed=7,
                               k=5 if activation == "topk" else None)
    tc, file = Transcoder.load(folder), load_file(str(folder / "layer_0.safetensors"))
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
    pre = F.linear(x, file["W_enc"], file["b_enc"])  # circuit-tracer's encoder
    if activation == "relu":
        features = torch.relu(pre)
    elif activation == "jumprelu":
        threshold = file["activation_function.threshold"]
        features = pre * (pre > threshold)
        assert ((pre > 0) & (pre <= threshold)).any()  # the threshold zeroes some positive pre-activations
    else:  # raw top-k values: pre * gate
        features = pre * torch.zeros_like(pre).scatter(-1, pre.topk(5, dim=-1).indices, 1.0)
        assert ((features != 0).sum(-1) == 5).all()
    torch.testing.assert_close(tc.encode(x), features, rtol=0, atol=1e-6)
    decoded = features @ file["W_dec"] + file["b_dec"]
    torch.testing.assert_close(tc.decode(features), decoded, rtol=0, atol=1e-6)
    torch.testing.assert_close(tc.skip(x), x @ file["W_skip"].T, rtol=0, atol=1e-6)
    torch.testing.assert_close(tc(x), decoded + x @ file["W_skip"].T, rtol=0, atol=1e-6)
    plain = Transcoder(tc.W_enc, tc.b_enc, tc.W_dec, tc.b_dec, "relu")  # no W_skip: the skip path is zero
    assert torch.equal(plain.skip(x), torch.zeros(3, 5, 16)) and torch.equal(plain(x), plain.decode(plain.encode(x)))


def test_loading_names_the_file_the_tensor_and_the_shapes(tmp_path):
    folder = write_transcoders(tmp_path / "ct", 16, 2, 32, seed=1)
    tensors = load_file(str(folder / "layer_1.safetensors"))
    save_file({**tensors, "W_dec": tensors["W_dec"].T.contiguous()}, str(folder / "layer_1.safetensors"))
    with pytest.raises(qgraph.InvalidArgument, match=r"layer_1\.safetensors: 'W_dec' has shape \[16, 32\], "
                                                     r"expected \[32, 16\]"):
        Transcoder.load(folder, layer=1)
    with pytest.raises(qgraph.InvalidArgument, match="for layers 0, 1; layer=5 is not there"):
        Transcoder.load(folder, layer=5)
    with pytest.raises(qgraph.InvalidArgument, match="no layer= was given"):
        Transcoder.load(folder)
    sae = write_saelens(tmp_path / "sae", d_in=16, d_sae=32, architecture="jumprelu")
    with pytest.raises(qgraph.InvalidArgument, match="not a transcoder's.*qgraph.SAE.load"):
        Transcoder.load(sae)
    with pytest.raises(qgraph.MissingFile):
        Transcoder.load(tmp_path / "nowhere")
    jump = write_transcoders(tmp_path / "jump", 16, 1, 32, activation="jumprelu")
    tensors = load_file(str(jump / "layer_0.safetensors"))
    tensors["activation_function.threshold"][3] = -0.5
    save_file(tensors, str(jump / "layer_0.safetensors"))
    with pytest.raises(qgraph.NotSupported, match="1 JumpReLU thresholds are negative"):
        Transcoder.load(jump)


# -- spliced into the model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tc(sdpa_model, tmp_path_factory):
    folder = write_transcoders(tmp_path_factory.mktemp("tc"), sdpa_model.config.hidden_size, 4, 256,
                               activation="jumprelu", skip=True, seed=2)
    return Transcoder.load(folder, layer=1)


@pytest.fixture(scope="module")
def spliced(sdpa_model, tc):
    return qgraph.instrument(sdpa_model, values=names(1), edits=["layers.1.transcoder.features"], transcoders={1: tc})


@pytest.fixture(scope="module")
def run(spliced, ids):
    return spliced(ids)


def test_the_values_are_the_transcoders_math_on_the_models_mlp(sdpa_model, tc, ids, run):
    logits, x, m = hooked_mlp(sdpa_model, ids, 1)
    torch.testing.assert_close(run.logits, hf_logits(sdpa_model, ids), rtol=0, atol=0)  # the error term is kept
    features = run["layers.1.transcoder.features"]
    torch.testing.assert_close(features, tc.encode(x), rtol=1e-5, atol=1e-5)
    assert 0.05 < (features != 0).float().mean() < 0.95
    torch.testing.assert_close(run["layers.1.transcoder.reconstruction"], tc(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run["layers.1.transcoder.reconstruction"] + run["layers.1.transcoder.error"], m,
                               rtol=0, atol=1e-5)
    assert run["layers.1.transcoder.error"].abs().max() > 0.1  # a random transcoder: the error is not nothing


def test_zeroing_a_feature_moves_the_mlp_output_by_its_decoder_row(sdpa_model, tc, ids, spliced, run):
    features = run["layers.1.transcoder.features"]
    f = int((features != 0).sum((0, 1)).argmax())
    a = features[..., f]
    out = spliced(ids, edits={"layers.1.transcoder.features": qgraph.Zero(neurons=[f])})
    edited = features.clone()
    edited[..., f] = 0
    assert torch.equal(out["layers.1.transcoder.features"], edited)
    expected, x, _ = hooked_mlp(sdpa_model, ids, 1, change=lambda x, m: m - a[..., None] * tc.W_dec[f])
    torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-5)
    assert (out.logits - run.logits).abs().max() > 1e-2
    torch.testing.assert_close(out["layers.1.transcoder.reconstruction"], tc.decode(edited) + tc.skip(x),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["layers.1.transcoder.error"], run["layers.1.transcoder.error"], rtol=0, atol=0)


def test_the_reconstruction_splice_feeds_the_transcoders_output(sdpa_model, tc, ids, run):
    ig = qgraph.instrument(sdpa_model, values=["layers.1.layer_mid", "layers.1.layer_output",
                                               "layers.1.transcoder.reconstruction"],
                           transcoders={1: tc}, splice="reconstruction")
    out = ig(ids)
    recon = out["layers.1.transcoder.reconstruction"]
    torch.testing.assert_close(out["layers.1.layer_output"], out["layers.1.layer_mid"] + recon, rtol=0, atol=1e-6)
    torch.testing.assert_close(recon, run["layers.1.transcoder.reconstruction"], rtol=0, atol=0)
    expected, _, _ = hooked_mlp(sdpa_model, ids, 1, change=lambda x, m: tc(x))
    torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splice", ["error", "reconstruction"])
def test_the_splice_is_its_formulas_bit_for_bit(sdpa_model, tc, ids, splice):
    """What block 1 adds to its stream and the transcoder's values, exactly, against its own decode
    and skip of the graph's features and MLP input: ``error = m - (decode(features0) + skip(x))``;
    with ``splice="error"`` the block reads ``m`` unedited and ``m + (decode(features) -
    decode(features0))`` edited (the skip path cancels); with ``"reconstruction"``,
    ``decode(features) + skip(x)``."""
    sides = ["layers.1.mlp_input", "layers.1.mlp.mlp_output", "layers.1.layer_mid", "layers.1.layer_output"]
    ig = qgraph.instrument(sdpa_model, values=[*sides, *names(1)], edits=["layers.1.transcoder.features"],
                           transcoders={1: tc}, splice=splice)
    plain = ig(ids)
    features0 = plain["layers.1.transcoder.features"]
    active = int((features0 != 0).sum((0, 1)).argmax())
    for out in (plain, ig(ids, edits={"layers.1.transcoder.features": qgraph.Scale(3.0, neurons=[active])})):
        x, m, mid, features = (out[name] for name in (*sides[:3], "layers.1.transcoder.features"))
        assert torch.equal(m, plain["layers.1.mlp.mlp_output"])  # the value itself stays the model's
        assert torch.equal(out["layers.1.transcoder.error"], m - (tc.decode(features0) + tc.skip(x)))
        recon = tc.decode(features) + tc.skip(x)
        assert torch.equal(out["layers.1.transcoder.reconstruction"], recon)
        reads = m + (tc.decode(features) - tc.decode(features0)) if out is not plain else m
        assert torch.equal(out["layers.1.layer_output"], mid + (recon if splice == "reconstruction" else reads))
    assert not torch.equal(features, features0)


def test_a_topk_transcoder_across_the_moe_block(sparse_model, tmp_path_factory):
    model = sparse_model("qwen3_5_moe")
    folder = write_transcoders(tmp_path_factory.mktemp("moe-tc"), model.config.hidden_size, [3], 128,
                               activation="topk", k=8, skip=True, seed=5)
    tc = Transcoder.load(folder, layer=3)  # block 3: the attention block, its MLP the sparse MoE block
    ig = qgraph.instrument(model, values=names(3, (*PARTS, "activations", "indices")),
                           edits=["layers.3.transcoder.features"], transcoders={3: tc})
    ids = random_ids(2, 12, seed=3)
    out = ig(ids)
    logits, x, m = hooked_mlp(model, ids, 3)
    torch.testing.assert_close(out.logits, qgraph.instrument(model)(ids).logits, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=1e-5)
    features = out["layers.3.transcoder.features"]
    torch.testing.assert_close(features, tc.encode(x), rtol=1e-5, atol=1e-5)
    activations, indices = tc.select(x)
    assert torch.equal(out["layers.3.transcoder.indices"], indices.int())
    torch.testing.assert_close(out["layers.3.transcoder.activations"], activations, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["layers.3.transcoder.reconstruction"] + out["layers.3.transcoder.error"], m,
                               rtol=0, atol=1e-5)
    f = int(indices[0, -1, 0])
    zeroed = ig(ids, edits={"layers.3.transcoder.features": qgraph.Zero(neurons=[f])})
    a = features[..., f]
    expected, _, _ = hooked_mlp(model, ids, 3, change=lambda x, m: m - a[..., None] * tc.W_dec[f])
    torch.testing.assert_close(zeroed.logits, expected, rtol=1e-5, atol=1e-5)
    assert (zeroed.logits - out.logits).abs().max() > 1e-3


def test_what_is_refused(sdpa_model, tc, tmp_path):
    hidden = sdpa_model.config.hidden_size
    narrow = Transcoder.load(write_transcoders(tmp_path / "narrow", hidden // 2, 2, 32), layer=1)
    with pytest.raises(qgraph.InvalidArgument, match=f"reads vectors of {hidden // 2}, but 'layers.1.mlp_input' has "
                                                     f"{hidden}"):
        qgraph.instrument(sdpa_model, transcoders={1: narrow})
    with pytest.raises(qgraph.OutOfRange, match="block 4: the model has blocks 0 to 3"):
        qgraph.instrument(sdpa_model, transcoders={4: tc})
    with pytest.raises(qgraph.InvalidArgument, match="is the transcoder of block 1: splice it at block 1"):
        qgraph.instrument(sdpa_model, transcoders={2: tc})
    with pytest.raises(qgraph.InvalidType, match="not a Transcoder"):
        qgraph.instrument(sdpa_model, transcoders={1: object()})
    with pytest.raises(qgraph.InvalidType, match="is a transcoder.*transcoders="):
        qgraph.instrument(sdpa_model, saes={"layers.1.mlp_input": tc})
    sae = qgraph.SAE(tc.W_enc, tc.b_enc, tc.W_enc.T.contiguous(), torch.zeros(hidden), "relu")
    with pytest.raises(qgraph.InvalidArgument, match="the tensor the SAE at 'layers.1.mlp.mlp_output' reads"):
        qgraph.instrument(sdpa_model, saes={"layers.1.mlp.mlp_output": sae}, transcoders={1: tc})
    with pytest.raises(qgraph.EditError):
        qgraph.instrument(sdpa_model, edits=["layers.1.transcoder.error"], transcoders={1: tc})
