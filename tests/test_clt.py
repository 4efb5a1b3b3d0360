"""Cross-layer transcoders: circuit-tracer's and Gemma Scope 2's folders loaded into one record (against
the tensors written, and against circuit-tracer's own loader and reconstruction), spliced across every
block's MLP (against the plain HF forward with hooks on every MLP and the CLT's math done from the
files), feature edits reaching every later block, the reconstruction splice, gradients, and what is
refused with which message."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

import qgraph
from conftest import hf_logits
from qgraph import CrossLayerTranscoder
from qgraph.testing import tiny_clt

PARTS = ("features", "reconstruction", "error")
BLOCKS = 4  # the tiny model's


def names(blocks=range(BLOCKS), parts=PARTS) -> list[str]:
    return [f"layers.{i}.transcoder.{part}" for i in blocks for part in parts]


class FileMath:
    """The CLT's math done from its files as the format stores them (not through the record):
    circuit-tracer's ``x @ W_enc_i.T``, Gemma Scope 2's ``x @ w_enc`` and its full ``w_dec``."""

    def __init__(self, folder, format: str):
        self.format, self.blocks = format, []
        for i in range(BLOCKS):
            if format == "circuit-tracer":
                enc, dec = load_file(str(folder / f"W_enc_{i}.safetensors")), load_file(str(folder / f"W_dec_{i}.safetensors"))
                self.blocks.append({"W_enc": enc[f"W_enc_{i}"], "b_enc": enc[f"b_enc_{i}"], "b_dec": enc[f"b_dec_{i}"],
                                    "threshold": enc.get(f"threshold_{i}"), "W_dec": dec[f"W_dec_{i}"]})
            else:
                self.blocks.append(load_file(str(folder / f"params_layer_{i}.safetensors")))

    def encode(self, i: int, x):
        b = self.blocks[i]
        pre = F.linear(x, b["W_enc"], b["b_enc"]) if self.format == "circuit-tracer" else x @ b["w_enc"] + b["b_enc"]
        return torch.relu(pre) if b.get("threshold") is None else pre * (pre > b["threshold"])

    def decode(self, j: int, features):
        """Every decoder that writes block j: sum over i <= j of features_i @ W_dec_i[:, j - i], plus b_dec_j."""
        if self.format == "circuit-tracer":
            total = sum(torch.einsum("...f,fd->...d", features[i], self.blocks[i]["W_dec"][:, j - i]) for i in range(j + 1))
        else:  # Gemma Scope 2's w_dec names every output block: [:, j]
            total = sum(torch.einsum("...f,fd->...d", features[i], self.blocks[i]["w_dec"][:, j]) for i in range(j + 1))
        return total + self.blocks[j]["b_dec"]

    def skip(self, j: int, x):
        w = self.blocks[j].get("affine_skip_connection")
        return torch.zeros_like(x) if w is None else x @ w


def hf_run(model, ids, reads: str, change=None, grad: bool = False):
    """The plain HF forward with hooks on every block's MLP (and its norm, for the stream before it):
    ``(logits, seen)``, ``seen[j]`` holding block j's ``x`` (what the CLT reads), ``m`` (the MLP's output)
    and ``out`` (what the model read instead, where ``change(j, seen)`` gives it)."""
    seen, handles = {}, []
    for j, layer in enumerate(model.model.layers):
        def norm_hook(module, args, j=j):
            seen.setdefault(j, {})["mid"] = args[0]

        def mlp_hook(module, args, output, j=j):
            seen[j]["x"] = args[0] if reads == "mlp_input" else seen[j]["mid"]
            seen[j]["m"] = output
            if change is not None:
                seen[j]["out"] = change(j, seen)
                return seen[j]["out"]
            return None

        handles += [layer.post_attention_layernorm.register_forward_pre_hook(norm_hook),
                    layer.mlp.register_forward_hook(mlp_hook)]
    try:
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, seen


# -- loading -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reads", ["mlp_input", "layer_mid"])
@pytest.mark.parametrize("jumprelu", [False, True])
def test_circuit_tracer_folders_load_the_tensors_written(sdpa_model, tmp_path, reads, jumprelu):
    folder = tiny_clt(tmp_path, sdpa_model, 32, jumprelu=jumprelu, reads=reads, seed=4)
    clt = CrossLayerTranscoder.load(folder)
    assert (clt.n_layers, clt.d_model, clt.d_transcoder, clt.reads) == (BLOCKS, 64, 32, reads)
    assert clt.activation == ("jumprelu" if jumprelu else "relu") and clt.W_skip is None
    assert repr(clt) == f"CrossLayerTranscoder(4 blocks, 32 features, {clt.activation}, reads {reads})"
    for i in range(BLOCKS):
        enc, dec = load_file(str(folder / f"W_enc_{i}.safetensors")), load_file(str(folder / f"W_dec_{i}.safetensors"))
        assert sorted(enc) == sorted([f"W_enc_{i}", f"b_enc_{i}", f"b_dec_{i}"] + [f"threshold_{i}"] * jumprelu)
        assert enc[f"W_enc_{i}"].shape == (32, 64) and dec[f"W_dec_{i}"].shape == (32, BLOCKS - i, 64)
        assert torch.equal(clt.W_enc[i], enc[f"W_enc_{i}"].T) and clt.W_enc[i].is_contiguous()
        assert torch.equal(clt.b_enc[i], enc[f"b_enc_{i}"]) and torch.equal(clt.b_dec[i], enc[f"b_dec_{i}"])
        assert torch.equal(clt.W_dec[i], dec[f"W_dec_{i}"])
        if jumprelu:
            assert torch.equal(clt.threshold[i], enc[f"threshold_{i}"])
        assert not any(p.requires_grad for p in clt.parameters())
    assert clt.threshold is None if not jumprelu else len(clt.threshold) == BLOCKS
    if reads == "layer_mid":
        config = yaml.safe_load((folder / "config.yaml").read_text())
        assert config == {"model_kind": "cross_layer_transcoder", "feature_input_hook": "hook_resid_mid",
                          "feature_output_hook": "hook_mlp_out"}
    else:
        assert not (folder / "config.yaml").exists()
        assert CrossLayerTranscoder.load(folder, reads="layer_mid").reads == "layer_mid"  # a bare folder says nothing
    half = CrossLayerTranscoder.load(folder, dtype=torch.float16)
    assert all(p.dtype == torch.float16 for p in half.parameters())
    assert torch.equal(half.W_dec[2], clt.W_dec[2].half())


def test_gemma_scope_2_folders_load_the_tensors_written(sdpa_model, tmp_path):
    folder = tiny_clt(tmp_path, sdpa_model, 32, jumprelu=True, seed=5, format="gemma-scope-2", skip=True)
    clt = CrossLayerTranscoder.load(folder)
    assert repr(clt) == "CrossLayerTranscoder(4 blocks, 32 features, jumprelu, reads mlp_input, skip)"
    for i in range(BLOCKS):
        params = load_file(str(folder / f"params_layer_{i}.safetensors"))
        assert params["w_enc"].shape == (64, 32) and params["w_dec"].shape == (32, BLOCKS, 64)
        assert torch.equal(clt.W_enc[i], params["w_enc"]) and torch.equal(clt.W_dec[i], params["w_dec"][:, i:])
        assert torch.equal(clt.W_skip[i], params["affine_skip_connection"])
        for name in ("b_enc", "b_dec", "threshold"):
            assert torch.equal(getattr(clt, name)[i], params[name]), name


@pytest.mark.parametrize("format", ["circuit-tracer", "gemma-scope-2"])
def test_encode_decode_and_skip_are_the_plain_math_on_the_files(sdpa_model, tmp_path, format):
    folder = tiny_clt(tmp_path, sdpa_model, 48, jumprelu=True, seed=6, format=format, skip=format != "circuit-tracer")
    clt, files = CrossLayerTranscoder.load(folder), FileMath(folder, format)
    xs = [torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(i)) for i in range(BLOCKS)]
    features = [files.encode(i, x) for i, x in enumerate(xs)]
    pre = xs[1] @ clt.W_enc[1] + clt.b_enc[1]
    assert ((pre > 0) & (pre <= clt.threshold[1])).any()  # the threshold zeroes some positive pre-activations
    for i in range(BLOCKS):
        torch.testing.assert_close(clt.encode(i, xs[i]), features[i], rtol=0, atol=1e-6)
        torch.testing.assert_close(clt.decode_to(i, features), files.decode(i, features), rtol=0, atol=1e-5)
        torch.testing.assert_close(clt.skip(i, xs[i]), files.skip(i, xs[i]), rtol=0, atol=1e-6)
    recon = clt(xs)
    torch.testing.assert_close(recon[3], files.decode(3, features) + files.skip(3, xs[3]), rtol=0, atol=1e-5)
    # b_dec[j] once per block, and block 0's features reach block 3 through W_dec[0][:, 3]
    zero = [torch.zeros(2, 5, 48)] * BLOCKS
    assert torch.equal(clt.decode_to(3, zero), clt.b_dec[3].expand(2, 5, 64))
    one = [features[0]] + zero[1:]
    torch.testing.assert_close(clt.decode_to(3, one) - clt.b_dec[3], features[0] @ clt.W_dec[0][:, 3], rtol=0, atol=1e-6)


def test_circuit_tracers_own_loader_reads_the_same_clt(sdpa_model, tmp_path):
    """circuit-tracer's ``load_clt`` on the folder gives the encoder and the reconstruction qgraph's record
    does (its features are JumpReLU'd as ours, its ``decode`` sums the decoders and adds b_dec per block)."""
    module = pytest.importorskip("circuit_tracer.transcoder.cross_layer_transcoder")
    folder = tiny_clt(tmp_path, sdpa_model, 32, jumprelu=True, seed=8)
    theirs = module.load_clt(str(folder), dtype=torch.float32, device=torch.device("cpu"), lazy_decoder=False)
    ours = CrossLayerTranscoder.load(folder)
    xs = torch.randn(BLOCKS, 6, 64, generator=torch.Generator().manual_seed(1))  # [n_layers, n_pos, d_model]
    features = [ours.encode(i, xs[i]) for i in range(BLOCKS)]
    for i in range(BLOCKS):
        torch.testing.assert_close(features[i], theirs.encode_layer(xs[i], i), rtol=0, atol=1e-6)
    decoded = theirs.decode(torch.stack(features))  # [n_layers, n_pos, d_model]
    for j in range(BLOCKS):
        torch.testing.assert_close(ours.decode_to(j, features), decoded[j], rtol=0, atol=1e-5)


def _rewrite(file, **changes):
    tensors = load_file(str(file))
    tensors.update(changes)
    save_file(tensors, str(file))


def test_loading_refuses_with_the_file_the_tensor_and_the_way_out(sdpa_model, tmp_path):
    def fresh(name, **kwargs):
        return tiny_clt(tmp_path / name, sdpa_model, 32, seed=1, **kwargs)

    folder = fresh("no-decoder")
    os.remove(folder / "W_dec_2.safetensors")
    with pytest.raises(qgraph.MissingFile, match=r"no W_dec_2\.safetensors beside W_enc_2\.safetensors"):
        CrossLayerTranscoder.load(folder)
    folder = fresh("no-encoder")
    os.remove(folder / "W_enc_1.safetensors")
    with pytest.raises(qgraph.MissingFile, match=r"no W_enc_1\.safetensors: the blocks are numbered from 0 with none "
                                                 r"missing \(it holds 0, 2, 3\)"):
        CrossLayerTranscoder.load(folder)
    folder = fresh("wide-decoder")
    _rewrite(folder / "W_dec_1.safetensors", W_dec_1=torch.zeros(32, 4, 64))
    with pytest.raises(qgraph.InvalidArgument, match=r"W_dec_1\.safetensors: 'W_dec_1' has shape \[32, 4, 64\], "
                                                     r"expected \[32, 3, 64\]"):
        CrossLayerTranscoder.load(folder)
    folder = fresh("narrow-bias")
    _rewrite(folder / "W_enc_3.safetensors", b_dec_3=torch.zeros(63))
    with pytest.raises(qgraph.InvalidArgument, match=r"W_enc_3\.safetensors: 'b_dec_3' has shape \[63\], expected \[64\]"):
        CrossLayerTranscoder.load(folder)
    folder = fresh("half-jumprelu", jumprelu=True)
    tensors = load_file(str(folder / "W_enc_2.safetensors"))
    del tensors["threshold_2"]
    save_file(tensors, str(folder / "W_enc_2.safetensors"))
    with pytest.raises(qgraph.InvalidArgument, match="no threshold_2, but W_enc_0.safetensors has threshold_0"):
        CrossLayerTranscoder.load(folder)
    folder = fresh("bad-hook", reads="layer_mid")
    (folder / "config.yaml").write_text(yaml.safe_dump({"feature_input_hook": "hook_resid_pre"}))
    with pytest.raises(qgraph.NotSupported, match="feature_input_hook 'hook_resid_pre': qgraph splices cross-layer "
                                                  "transcoders that read one of ln2.hook_normalized, mlp.hook_in, "
                                                  "hook_resid_mid, hook_mlp_in$"):
        CrossLayerTranscoder.load(folder)
    for hook, reads in [("hook_mlp_in", "layer_mid"), ("ln2.hook_normalized", "mlp_input")]:  # the family's table's
        (folder / "config.yaml").write_text(yaml.safe_dump({"feature_input_hook": hook}))
        assert CrossLayerTranscoder.load(folder).reads == reads
    (folder / "config.yaml").write_text(yaml.safe_dump({"feature_input_hook": "blocks.0.hook_mlp_in"}))
    with pytest.raises(qgraph.NotSupported, match="feature_input_hook 'blocks.0.hook_mlp_in'"):  # one block's
        CrossLayerTranscoder.load(folder)
    (folder / "config.yaml").write_text(yaml.safe_dump({"feature_output_hook": "hook_resid_post"}))
    with pytest.raises(qgraph.NotSupported, match="feature_output_hook 'hook_resid_post'.*hook_mlp_out or mlp.hook_out"):
        CrossLayerTranscoder.load(folder)
    (folder / "config.yaml").write_text(yaml.safe_dump({"model_kind": "transcoder_set"}))
    with pytest.raises(qgraph.NotSupported, match="not a cross_layer_transcoder: a per-layer set loads with "
                                                  r"qgraph.Transcoder.load\(path, layer=i\)"):
        CrossLayerTranscoder.load(folder)
    (folder / "config.yaml").write_text(yaml.safe_dump({"feature_input_hook": "mlp.hook_in"}))
    with pytest.raises(qgraph.InvalidArgument, match="reads='layer_mid', but .* says it reads 'mlp.hook_in'"):
        CrossLayerTranscoder.load(folder, reads="layer_mid")
    # not safetensors: a pickle beside, a file given, bytes that are no safetensors
    folder = fresh("pickled")
    torch.save({"W_enc_4": torch.zeros(3)}, folder / "W_enc_4.pt")
    with pytest.raises(qgraph.NotSupported, match=r"W_enc_4\.pt: qgraph reads cross-layer transcoders from "
                                                  "safetensors files only"):
        CrossLayerTranscoder.load(folder)
    with pytest.raises(qgraph.InvalidArgument, match="not a file of a cross-layer transcoder qgraph reads"):
        CrossLayerTranscoder.load(folder / "W_enc_4.pt")
    folder = fresh("garbage")
    (folder / "W_dec_0.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(qgraph.InvalidArgument, match=r"W_dec_0\.safetensors: not a safetensors file that can be read"):
        CrossLayerTranscoder.load(folder)
    folder, outside = fresh("linked"), fresh("outside")
    os.remove(folder / "W_dec_3.safetensors")
    os.symlink(outside / "W_dec_3.safetensors", folder / "W_dec_3.safetensors")
    with pytest.raises(qgraph.InvalidArgument, match="a link out of the folder"):
        CrossLayerTranscoder.load(folder)
    folder = fresh("extra")
    save_file({"W_dec_4": torch.zeros(32, 0, 64)}, str(folder / "W_dec_4.safetensors"))
    with pytest.raises(qgraph.InvalidArgument, match=r"W_dec_4\.safetensors has no W_enc_4\.safetensors: the encoders "
                                                     r"name 4 blocks"):
        CrossLayerTranscoder.load(folder)
    gemma = tiny_clt(tmp_path / "gemma", sdpa_model, 32, jumprelu=True, format="gemma-scope-2")
    _rewrite(gemma / "params_layer_2.safetensors", w_dec=torch.zeros(32, 3, 64))
    with pytest.raises(qgraph.InvalidArgument, match=r"params_layer_2\.safetensors: 'w_dec' has shape \[32, 3, 64\], "
                                                     r"expected \[32, 4, 64\]"):
        CrossLayerTranscoder.load(gemma)
    with pytest.raises(qgraph.MissingFile, match="no cross-layer transcoder in"):
        CrossLayerTranscoder.load(tmp_path / "gemma" / ".." / "garbage" / ".." / "..")
    with pytest.raises(qgraph.MissingFile, match="the path does not exist"):
        CrossLayerTranscoder.load(tmp_path / "nowhere")


def test_the_record_checks_its_shapes_and_inputs():
    W_enc, b_enc = [torch.zeros(8, 4)] * 2, [torch.zeros(4)] * 2
    W_dec, b_dec = [torch.zeros(4, 2, 8), torch.zeros(4, 1, 8)], [torch.zeros(8)] * 2
    clt = CrossLayerTranscoder(W_enc, b_enc, W_dec, b_dec)
    assert (clt.n_layers, clt.d_model, clt.d_transcoder, clt.activation) == (2, 8, 4, "relu")
    with pytest.raises(qgraph.InvalidArgument, match=r"W_dec\[1\] has shape \[4, 2, 8\], expected \[4, 1, 8\]"):
        CrossLayerTranscoder(W_enc, b_enc, [torch.zeros(4, 2, 8)] * 2, b_dec)
    with pytest.raises(qgraph.InvalidArgument, match="threshold has 1 blocks but W_enc has 2"):
        CrossLayerTranscoder(W_enc, b_enc, W_dec, b_dec, threshold=[torch.zeros(4)])
    with pytest.raises(qgraph.InvalidArgument, match="W_enc should be a list of tensors, one per block"):
        CrossLayerTranscoder(torch.zeros(2, 8, 4), b_enc, W_dec, b_dec)
    with pytest.raises(qgraph.InvalidArgument, match="reads='layer_output'"):
        CrossLayerTranscoder(W_enc, b_enc, W_dec, b_dec, reads="layer_output")
    with pytest.raises(qgraph.InvalidArgument, match=r"block 1's input should be \[\.\.\., 8\], not \[3, 7\]"):
        clt.encode(1, torch.zeros(3, 7))
    with pytest.raises(qgraph.OutOfRange, match="block 2: .* has blocks 0 to 1"):
        clt.encode(2, torch.zeros(3, 8))
    with pytest.raises(qgraph.InvalidArgument, match=r"decode_to\(1, \.\.\.\) reads the features of blocks 0 to 1"):
        clt.decode_to(1, [torch.zeros(3, 4)])


# -- spliced into the model ------------------------------------------------------------------------------
VARIANTS = {  # name: (format, reads, jumprelu, skip)
    "relu-mlp_input": ("circuit-tracer", "mlp_input", False, False),
    "jumprelu-layer_mid": ("circuit-tracer", "layer_mid", True, False),
    "gemma-scope-2-skip": ("gemma-scope-2", "mlp_input", True, True),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, sdpa_model, tmp_path_factory):
    format, reads, jumprelu, skip = VARIANTS[request.param]
    folder = tiny_clt(tmp_path_factory.mktemp("clt"), sdpa_model, 96, jumprelu=jumprelu, reads=reads, seed=2,
                      format=format, skip=skip)
    clt = CrossLayerTranscoder.load(folder)
    ig = qgraph.instrument(sdpa_model, values=names() + ["layers.0.layer_output"],
                           edits=["layers.0.transcoder.features", "layers.1.transcoder.features"], transcoders=clt)
    return clt, FileMath(folder, format), ig


def test_the_values_are_the_clts_math_on_the_models_mlps(sdpa_model, ids, variant):
    clt, files, ig = variant
    run = ig(ids)
    assert torch.equal(run.logits, hf_logits(sdpa_model, ids))  # unedited: the model's logits, bit for bit
    assert torch.equal(run.logits, qgraph.instrument(sdpa_model)(ids).logits)
    _, seen = hf_run(sdpa_model, ids, clt.reads)
    features = [files.encode(i, seen[i]["x"]) for i in range(BLOCKS)]
    for j in range(BLOCKS):
        got = run[f"layers.{j}.transcoder.features"]
        assert got.shape == (*ids.shape, 96)
        torch.testing.assert_close(got, features[j], rtol=1e-5, atol=1e-5)
        assert 0.02 < (got != 0).float().mean() < 0.98
        recon = files.decode(j, features) + files.skip(j, seen[j]["x"])
        torch.testing.assert_close(run[f"layers.{j}.transcoder.reconstruction"], recon, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run[f"layers.{j}.transcoder.error"], seen[j]["m"] - recon, rtol=1e-5, atol=1e-5)
    assert run["layers.3.transcoder.error"].abs().max() > 0.1  # a random CLT: the error is not nothing
    # block 3's reconstruction reads block 0's features: without them it is another
    partial = files.decode(3, [torch.zeros_like(features[0])] + features[1:])
    assert (partial - run["layers.3.transcoder.reconstruction"]).abs().max() > 1e-2


def test_an_edit_at_block_0_reaches_every_later_blocks_mlp_output(sdpa_model, ids, variant):
    clt, files, ig = variant
    run = ig(ids)
    base = run["layers.0.transcoder.features"]
    f = int((base != 0).sum((0, 1)).argmax())
    out = ig(ids, edits={"layers.0.transcoder.features": qgraph.Scale(3.0, neurons=[f])})
    edited0 = base.clone()
    edited0[..., f] *= 3.0
    assert torch.equal(out["layers.0.transcoder.features"], edited0)

    def change(j, seen):  # output + (decode(edited) - decode(original)), this run's features
        original = [files.encode(i, seen[i]["x"]) for i in range(j + 1)]
        edited = [original[0].clone()] + original[1:]
        edited[0][..., f] *= 3.0
        return seen[j]["m"] + (files.decode(j, edited) - files.decode(j, original))

    expected, seen = hf_run(sdpa_model, ids, clt.reads, change=change)
    torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-5)
    assert (out.logits - run.logits).abs().max() > 1e-2
    for j in range(BLOCKS):  # block j's MLP output moved by block 0's decoder to it, W_dec[0][:, j]
        moved = seen[j]["out"] - seen[j]["m"]
        torch.testing.assert_close(moved, (edited0 - base)[..., f, None] * files_row(files, f, j), rtol=1e-4, atol=1e-5)
        assert moved.abs().max() > 1e-3
        features = [files.encode(i, seen[i]["x"]) for i in range(j + 1)]
        features[0] = edited0
        torch.testing.assert_close(out[f"layers.{j}.transcoder.reconstruction"],
                                   files.decode(j, features) + files.skip(j, seen[j]["x"]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["layers.0.transcoder.error"], run["layers.0.transcoder.error"], rtol=0, atol=0)
    # an edit at block 1 leaves block 0 alone, bit for bit
    later = ig(ids, edits={"layers.1.transcoder.features": qgraph.Zero()})
    assert torch.equal(later["layers.0.layer_output"], run["layers.0.layer_output"])
    assert (later.logits - run.logits).abs().max() > 1e-3


def files_row(files: FileMath, f: int, j: int):
    """Block 0's feature f's decoder to block j, from the file."""
    b = files.blocks[0]
    return b["W_dec"][f, j] if files.format == "circuit-tracer" else b["w_dec"][f, j]


def test_the_reconstruction_splice_feeds_every_blocks_reconstruction(sdpa_model, ids, tmp_path):
    folder = tiny_clt(tmp_path, sdpa_model, 96, jumprelu=True, seed=3)
    clt, files = CrossLayerTranscoder.load(folder), FileMath(folder, "circuit-tracer")
    ig = qgraph.instrument(sdpa_model, values=["layers.2.layer_mid", "layers.2.layer_output",
                                               *names(parts=("reconstruction",))], transcoders=clt, splice="reconstruction")
    out = ig(ids)
    torch.testing.assert_close(out["layers.2.layer_output"],
                               out["layers.2.layer_mid"] + out["layers.2.transcoder.reconstruction"], rtol=0, atol=1e-6)

    def change(j, seen):
        return files.decode(j, [files.encode(i, seen[i]["x"]) for i in range(j + 1)])

    expected, seen = hf_run(sdpa_model, ids, "mlp_input", change=change)
    torch.testing.assert_close(out.logits, expected, rtol=1e-4, atol=1e-4)
    for j in range(BLOCKS):
        torch.testing.assert_close(out[f"layers.{j}.transcoder.reconstruction"], seen[j]["out"], rtol=1e-4, atol=1e-5)
    assert (out.logits - hf_logits(sdpa_model, ids)).abs().max() > 1e-2


def test_gradients_reach_the_features_through_every_later_decoder(sdpa_model, ids, tmp_path):
    folder = tiny_clt(tmp_path, sdpa_model, 96, jumprelu=True, seed=7)
    clt, files = CrossLayerTranscoder.load(folder), FileMath(folder, "circuit-tracer")
    ig = qgraph.instrument(sdpa_model, values={"layers.0.transcoder.features": {"grad": True},
                                               "layers.2.transcoder.features": {"grad": True}},
                           edits=["layers.0.transcoder.features", "layers.2.transcoder.features"], transcoders=clt)

    def loss(logits):
        return logits[:, -1, :7].square().sum() + logits[:, 2, 3].sum()

    out = ig(ids)
    loss(out.logits).backward()
    sdpa_model.zero_grad(set_to_none=True)
    grad = out.grad("layers.0.transcoder.features")
    assert grad.shape == (*ids.shape, 96) and grad.abs().max() > 1e-4
    assert out.grad("layers.2.transcoder.features").abs().max() > 1e-4
    assert not any(p.requires_grad or p.grad is not None for p in clt.parameters())
    # the same through HF: a zero delta on block 0's features, decoded into every block's MLP output
    delta = torch.zeros(*ids.shape, 96, requires_grad=True)
    zeros = [torch.zeros(*ids.shape, 96)] * BLOCKS

    def change(j, seen):
        return seen[j]["m"] + files.decode(j, [delta] + zeros[1:]) - files.blocks[j]["b_dec"]

    logits, _ = hf_run(sdpa_model, ids, "mlp_input", change=change, grad=True)
    loss(logits).backward()
    sdpa_model.zero_grad(set_to_none=True)
    torch.testing.assert_close(grad, delta.grad, rtol=1e-4, atol=1e-6)


def test_what_the_splice_refuses(sdpa_model, tmp_path):
    clt = CrossLayerTranscoder.load(tiny_clt(tmp_path / "ok", sdpa_model, 32))
    short = CrossLayerTranscoder(list(clt.W_enc)[:3], list(clt.b_enc)[:3],
                                 [w[:, :3 - i] for i, w in enumerate(list(clt.W_dec)[:3])], list(clt.b_dec)[:3])
    with pytest.raises(qgraph.InvalidArgument, match="has 3 blocks, but the model has 4: load the cross-layer "
                                                     "transcoder trained on this model"):
        qgraph.instrument(sdpa_model, transcoders=short)
    narrow = CrossLayerTranscoder.load(tiny_clt(tmp_path / "narrow", SimpleNamespace(num_hidden_layers=4, hidden_size=32),
                                                16))
    with pytest.raises(qgraph.InvalidArgument, match="block 0 of circuit-tracer CLT .* reads vectors of 32, but "
                                                     "'layers.0.mlp_input' has 64"):
        qgraph.instrument(sdpa_model, transcoders=narrow)
    with pytest.raises(qgraph.InvalidType, match="transcoders\\[1\\] is a cross-layer transcoder.*transcoders=clt"):
        qgraph.instrument(sdpa_model, transcoders={1: clt})
    with pytest.raises(qgraph.InvalidType, match="is a transcoder"):
        qgraph.instrument(sdpa_model, saes={"layers.1.mlp_input": clt})
    with pytest.raises(qgraph.EditError):
        qgraph.instrument(sdpa_model, edits=["layers.2.transcoder.error"], transcoders=clt)
    with pytest.raises(qgraph.UnavailableValue, match="a cross-layer transcoder"):
        qgraph.instrument(sdpa_model, values=["layers.2.transcoder.indices"], transcoders=clt)


def test_a_clt_across_the_moe_blocks(sparse_model, tmp_path):
    model = sparse_model("qwen3_5_moe")
    folder = tiny_clt(tmp_path, model, 64, jumprelu=True, seed=9)
    clt, files = CrossLayerTranscoder.load(folder), FileMath(folder, "circuit-tracer")
    ig = qgraph.instrument(model, values=names(), edits=["layers.0.transcoder.features"], transcoders=clt)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    out = ig(ids)
    assert torch.equal(out.logits, hf_logits(model, ids))
    _, seen = hf_run(model, ids, "mlp_input")
    features = [files.encode(i, seen[i]["x"]) for i in range(BLOCKS)]
    for j in range(BLOCKS):
        recon = files.decode(j, features)
        torch.testing.assert_close(out[f"layers.{j}.transcoder.features"], features[j], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[f"layers.{j}.transcoder.reconstruction"], recon, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[f"layers.{j}.transcoder.error"], seen[j]["m"] - recon, rtol=1e-5, atol=1e-5)
    zeroed = ig(ids, edits={"layers.0.transcoder.features": qgraph.Zero()})

    def change(j, seen):
        return seen[j]["m"] - (files.decode(j, [features[0]] + [torch.zeros_like(features[0])] * j) - files.blocks[j]["b_dec"])

    expected, _ = hf_run(model, ids, "mlp_input", change=change)
    torch.testing.assert_close(zeroed.logits, expected, rtol=1e-5, atol=1e-5)
    assert (zeroed.logits - out.logits).abs().max() > 1e-2


def test_a_saved_program_keeps_the_clt(sdpa_model, ids, tmp_path):
    clt = CrossLayerTranscoder.load(tiny_clt(tmp_path / "clt", sdpa_model, 64, jumprelu=True, seed=3,
                                             format="gemma-scope-2", skip=True))
    ig = qgraph.instrument(sdpa_model, values=names(), edits=["layers.0.transcoder.features"], transcoders=clt)
    edit = {"layers.0.transcoder.features": qgraph.Scale(0.0, neurons=[1, 2, 3])}
    out, edited = ig(ids), ig(ids, edits=edit)
    ig.save(tmp_path / "clt.qgraph")
    loaded = qgraph.load(tmp_path / "clt.qgraph", weights=sdpa_model)
    again, again_edited = loaded(ids), loaded(ids, edits=edit)
    assert torch.equal(again.logits, out.logits) and torch.equal(again_edited.logits, edited.logits)
    assert (edited.logits - out.logits).abs().max() > 1e-3
    for name in names():
        torch.testing.assert_close(again[name], out[name], rtol=0, atol=1e-6)
