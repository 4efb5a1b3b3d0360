"""Loading SAEs (issue 15, part 1): the record's math against plain torch, the three formats loading to
the same record from the same weights, k from the repo name, and what is refused says why."""
from __future__ import annotations

import json

import pytest
import torch

from qgraph.saes import SAE
from qgraph.saes.fixtures import weights, write_qwen_scope, write_saelens, write_sparsify

D_IN, D_SAE, K = 64, 256, 8


def inputs(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 5, D_IN, generator=torch.Generator().manual_seed(seed))


def rewrite_cfg(folder, **changes):
    """Change (or, with None, drop) keys of a folder's cfg.json."""
    cfg = json.loads((folder / "cfg.json").read_text())
    cfg.update(changes)
    (folder / "cfg.json").write_text(json.dumps({key: value for key, value in cfg.items() if value is not None}))


# -- plain-torch references, written from each library's encoder ------------------------------------

def pre_acts(w, x, subtract_b_dec=True):
    return (x - w["b_dec"] if subtract_b_dec else x) @ w["W_enc"] + w["b_enc"]


def saelens_topk(pre, k):  # SAELens TopK: topk of pre, then relu of the kept values
    values, indices = torch.topk(pre, k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, indices, torch.relu(values))


def sparsify_topk(pre, k):  # sparsify: topk of relu(pre)
    values, indices = torch.topk(torch.relu(pre), k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, indices, values)


def qwen_scope_topk(pre, k):  # Qwen-Scope's model card: topk of pre, raw values
    values, indices = torch.topk(pre, k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, indices, values)


@pytest.mark.parametrize("architecture", ["topk", "jumprelu", "standard"])
def test_saelens_encode_and_decode_are_the_plain_math(tmp_path, architecture):
    k = K if architecture == "topk" else None
    sae = SAE.load(write_saelens(tmp_path, D_IN, D_SAE, architecture, k=k))
    w, x = weights(D_IN, D_SAE), inputs()
    pre = pre_acts(w, x)
    expected = {"topk": lambda: saelens_topk(pre, K), "standard": lambda: torch.relu(pre),
                "jumprelu": lambda: torch.relu(pre) * (pre > w["threshold"])}[architecture]()
    features = sae.encode(x)
    torch.testing.assert_close(features, expected, rtol=0, atol=0)
    assert (features != 0).any() and (features == 0).any()
    torch.testing.assert_close(sae.decode(features), features @ w["W_dec"] + w["b_dec"], rtol=0, atol=0)
    torch.testing.assert_close(sae(x), sae.decode(features), rtol=0, atol=0)
    assert sae.activation == {"standard": "relu"}.get(architecture, architecture)


def test_sparsify_and_qwen_scope_encode_as_their_libraries(tmp_path):
    w, x = weights(D_IN, D_SAE), inputs()
    sparsify = SAE.load(write_sparsify(tmp_path / "sparsify", D_IN, D_SAE, K))
    qwen = SAE.load(write_qwen_scope(tmp_path / "qwen", 0, D_IN, D_SAE), layer=0, k=K)
    torch.testing.assert_close(sparsify.encode(x), sparsify_topk(pre_acts(w, x), K), rtol=0, atol=0)
    torch.testing.assert_close(qwen.encode(x), qwen_scope_topk(pre_acts(w, x, subtract_b_dec=False), K),
                               rtol=0, atol=0)
    assert ((sparsify.encode(x) != 0).sum(-1) == K).all()


def test_the_two_topk_orders_agree_when_few_pre_activations_are_positive():
    """SAELens's relu(topk(pre)) and sparsify's topk(relu(pre)) give the same dense features, also
    where fewer than k are positive; Qwen-Scope's raw topk keeps the negative ones."""
    w = weights(D_IN, D_SAE)
    b_enc = w["b_enc"].clone()
    b_enc[3:] = -10.0  # at most 3 features can be positive
    sae = SAE(w["W_enc"], b_enc, w["W_dec"], w["b_dec"], "topk", k=K, subtract_b_dec=True)
    x, w["b_enc"] = inputs(), b_enc
    pre = pre_acts(w, x)
    features = sae.encode(x)
    torch.testing.assert_close(features, saelens_topk(pre, K), rtol=0, atol=0)
    torch.testing.assert_close(features, sparsify_topk(pre, K), rtol=0, atol=0)
    assert ((features != 0).sum(-1) <= 3).all()
    raw = SAE(w["W_enc"], b_enc, w["W_dec"], w["b_dec"], "topk", k=K, subtract_b_dec=True, topk_relu=False)
    torch.testing.assert_close(raw.encode(x), qwen_scope_topk(pre, K), rtol=0, atol=0)
    assert (raw.encode(x) < 0).any()
    # the sparse form is the encoder's selection, the negative pre-activations it kept included
    values, indices = torch.topk(pre, K, dim=-1)
    for record, activations in ((sae, torch.relu(values)), (raw, values)):
        assert torch.equal(record.select(x)[1], indices) and torch.equal(record.select(x)[0], activations)
        assert torch.equal(record.dense(*record.select(x)), record.encode(x))
    with pytest.raises(ValueError, match="the sparse form is a TopK SAE's .* this one is relu"):
        SAE(w["W_enc"], b_enc, w["W_dec"], w["b_dec"], "relu").select(x)


def test_it_computes_in_its_dtype_and_answers_in_the_inputs(tmp_path):
    sae = SAE.load(write_saelens(tmp_path, D_IN, D_SAE, "topk", k=K))
    x = inputs().to(torch.bfloat16)
    features = sae.encode(x)
    assert features.dtype == torch.bfloat16 and sae.decode(features).dtype == torch.bfloat16
    torch.testing.assert_close(features, sae.encode(x.float()).to(torch.bfloat16), rtol=0, atol=0)
    assert sae.to(torch.float64).encode(inputs()).dtype == torch.float32


def test_the_three_formats_load_to_the_same_record(tmp_path):
    qwen = SAE.load(write_qwen_scope(tmp_path / "qwen", 2, D_IN, D_SAE, k=K), layer=2)
    saelens = SAE.load(write_saelens(tmp_path / "saelens", D_IN, D_SAE, "topk", k=K,
                                     hook_name="blocks.2.hook_resid_post"))
    sparsify = SAE.load(write_sparsify(tmp_path / "sparsify", D_IN, D_SAE, K, layer=2))
    for other in (saelens, sparsify):
        for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
            assert torch.equal(getattr(qwen, name), getattr(other, name)), name
        for name in ("d_in", "d_sae", "activation", "k", "hook", "threshold"):
            assert getattr(qwen, name) == getattr(other, name), name
    assert (qwen.d_in, qwen.d_sae, qwen.k, qwen.hook) == (D_IN, D_SAE, K, "layers.2.layer_output")
    # each format's conventions: only Qwen-Scope reads x itself, and keeps raw top-k values
    assert (qwen.subtract_b_dec, saelens.subtract_b_dec, sparsify.subtract_b_dec) == (False, True, True)
    assert (qwen.topk_relu, saelens.topk_relu, sparsify.topk_relu) == (False, True, True)
    x = inputs()
    torch.testing.assert_close(sparsify.encode(x), saelens.encode(x), rtol=0, atol=0)
    torch.testing.assert_close(sparsify.encode(x), qwen.encode(x - qwen.b_dec), rtol=0, atol=0)
    assert [s.source.split()[0] for s in (qwen, saelens, sparsify)] == ["Qwen-Scope", "SAELens", "sparsify"]
    other_seed = SAE.load(write_sparsify(tmp_path / "seed1", D_IN, D_SAE, K, seed=1))
    assert not torch.equal(other_seed.W_enc, sparsify.W_enc)


def test_k_comes_from_the_repo_name_or_the_argument(tmp_path):
    folder = write_qwen_scope(tmp_path, 3, D_IN, D_SAE, k=16)
    assert folder.name.endswith("L0_16") and SAE.load(folder, layer=3).k == 16
    assert SAE.load(folder / "layer3.sae.pt").k == 16  # the file itself: its layer from its name
    assert SAE.load(folder / "layer3.sae.pt").hook == "layers.3.layer_output"
    assert SAE.load(folder, layer=3, k=4).k == 4
    plain = write_qwen_scope(tmp_path / "plain", 3, D_IN, D_SAE)
    with pytest.raises(ValueError, match=r"do not store TopK's k .* give k="):
        SAE.load(plain, layer=3)
    assert SAE.load(write_sparsify(tmp_path / "sp", D_IN, D_SAE, K), k=12).k == 12


def test_older_and_other_saelens_configs(tmp_path):
    folder = write_saelens(tmp_path, D_IN, D_SAE, "topk", k=K)
    # SAELens 5: TopK as a "standard" architecture with activation_fn_str, the hook name at the top
    rewrite_cfg(folder, architecture="standard", k=None, metadata=None, activation_fn_str="topk",
                activation_fn_kwargs={"k": 5}, hook_name="blocks.4.hook_resid_pre")
    old = SAE.load(folder)
    assert (old.activation, old.k, old.hook) == ("topk", 5, "layers.4.layer_input")
    for hook_name, hook in [("blocks.4.hook_resid_mid", "layers.4.layer_mid"), ("blocks.4.hook_mlp_out",
                            "layers.4.mlp.mlp_output"), ("blocks.4.attn.hook_z", None)]:
        rewrite_cfg(folder, hook_name=hook_name)
        assert SAE.load(folder).hook == hook
    assert SAE.load(folder, hook="layers.4.layer_output").hook == "layers.4.layer_output"
    rewrite_cfg(folder, apply_b_dec_to_input=False)
    assert SAE.load(folder).subtract_b_dec is False
    rewrite_cfg(folder, normalize_activations="expected_average_only_in")
    with pytest.raises(NotImplementedError, match="normalize_activations='expected_average_only_in'"):
        SAE.load(folder)


def test_a_folder_of_layers_picks_one(tmp_path):
    for layer in (1, 3):
        write_qwen_scope(tmp_path / "qwen", layer, D_IN, D_SAE, seed=layer, k=K)
        write_sparsify(tmp_path / "sparsify", D_IN, D_SAE, K, seed=layer, layer=layer)
    qwen, sparsify = tmp_path / "qwen" / f"SAE-Res-Tiny-W{D_SAE}-L0_{K}", tmp_path / "sparsify"
    assert torch.equal(SAE.load(qwen, layer=3).W_enc, SAE.load(sparsify, layer=3).W_enc)
    assert SAE.load(sparsify, layer=1).hook == "layers.1.layer_output"
    for folder in (qwen, sparsify):
        with pytest.raises(ValueError, match=r"for layers 1, 3; layer=2 is not there: give layer="):
            SAE.load(folder, layer=2)
        with pytest.raises(ValueError, match="for layers 1, 3; no layer= was given"):
            SAE.load(folder)
    with pytest.raises(ValueError, match=r"is the SAE of layer 1 \(layers.1.layer_output\), not layer=3"):
        SAE.load(sparsify / "layers.1", layer=3)


def test_what_is_refused_says_why(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SAE.load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no SAE in"):
        SAE.load(tmp_path)
    folder = write_saelens(tmp_path / "gated", D_IN, D_SAE, "standard")
    rewrite_cfg(folder, architecture="gated")
    with pytest.raises(ValueError, match=r"gated/cfg.json: unknown SAE architecture 'gated'"):
        SAE.load(folder)
    (folder / "sae_weights.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="cfg.json has no weights beside it"):
        SAE.load(folder)
    sparsify = write_sparsify(tmp_path / "sparsify", D_IN, D_SAE, K)
    rewrite_cfg(sparsify, num_latents=512)
    with pytest.raises(ValueError, match="says num_latents=512 but the weights have 256"):
        SAE.load(sparsify)
    rewrite_cfg(sparsify, transcode=True)
    with pytest.raises(NotImplementedError, match="a transcoder"):
        SAE.load(sparsify)


def test_shapes_that_disagree_name_the_file_and_tensor(tmp_path):
    from safetensors.torch import save_file
    folder = write_saelens(tmp_path / "saelens", D_IN, D_SAE, "topk", k=K)
    w = weights(D_IN, D_SAE)
    save_file({"W_enc": w["W_enc"], "b_enc": w["b_enc"], "W_dec": w["W_dec"][:, :32].contiguous(),
               "b_dec": w["b_dec"]}, str(folder / "sae_weights.safetensors"))
    with pytest.raises(ValueError, match=r"sae_weights.safetensors: 'W_dec' has shape \[256, 32\], expected "
                                         r"\[d_sae d_in\] \(d_in=64, d_sae=256"):
        SAE.load(folder)
    qwen = write_qwen_scope(tmp_path / "qwen", 0, D_IN, D_SAE)
    torch.save({"W_enc": w["W_enc"].T, "b_enc": w["b_enc"][:10], "W_dec": w["W_dec"].T, "b_dec": w["b_dec"]},
               qwen / "layer0.sae.pt")
    with pytest.raises(ValueError, match=r"layer0.sae.pt: 'b_enc' has shape \[10\]"):
        SAE.load(qwen, layer=0, k=K)
    torch.save({"W_enc": w["W_enc"].T}, qwen / "layer0.sae.pt")
    with pytest.raises(ValueError, match="layer0.sae.pt: no tensor 'b_enc'"):
        SAE.load(qwen, layer=0, k=K)
    with pytest.raises(ValueError, match=r"b_dec has shape \[3\]"):
        SAE(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"][:3], "relu")


def test_check_fits_k_and_direction(tmp_path):
    sae = SAE.load(write_saelens(tmp_path, D_IN, D_SAE, "topk", k=K, hook_name="blocks.1.hook_resid_post"))
    sae.check_fits(D_IN, "layers.1.layer_output")
    with pytest.raises(ValueError, match=r"SAELens .* reads vectors of d_in=64, but 'layers.1.layer_output' has 128"):
        sae.check_fits(128, "layers.1.layer_output")
    assert torch.equal(sae.direction(5), sae.W_dec[5]) and sae.direction(5).shape == (D_IN,)
    with pytest.raises(IndexError, match="features 0 to 255"):
        sae.direction(D_SAE)
    with pytest.raises(ValueError, match="needs k from 1 to its d_sae 256, not 300"):
        SAE.load(tmp_path, k=300)
    w = weights(D_IN, D_SAE)
    with pytest.raises(ValueError, match="k=4 is for TopK SAEs; this one is relu"):
        SAE(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], "relu", k=4)
    assert not any(p.requires_grad for p in sae.parameters()) and sae.threshold is None
