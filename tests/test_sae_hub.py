"""Dictionaries by name (issue 55, item 6): ``SAE.load``, ``Transcoder.load`` and ``CrossLayerTranscoder.load``
of a Hugging Face Hub repository id, through huggingface_hub's own code, with no network: each test lays out
a Hub cache in tmp as huggingface_hub does (``models--org--repo/blobs/<sha256>``, ``snapshots/<commit>/...``
links to them, ``refs/main``) from the fixtures' files, with ``HF_HUB_OFFLINE`` on (where a test turns it
off, the Hub's listing is stood in for). What loads by name equals what loads from the same files by path."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import qgraph
from conftest import random_ids
from qgraph.errors import InvalidArgument, MissingFile
from qgraph.saes import SAE, Transcoder, bounds
from qgraph.saes.clt import CrossLayerTranscoder
from qgraph.saes.fixtures import tiny_clt, write_qwen_scope, write_saelens, write_transcoders

COMMIT = "0123456789abcdef0123456789abcdef01234567"
HOOKS = ("blocks.1.hook_resid_post", "blocks.2.hook_resid_post")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hub cache of this test's own, offline (huggingface_hub reads its settings at import: they
    are set on its constants as well as in the environment)."""
    from huggingface_hub import constants
    folder = tmp_path / "hub"
    folder.mkdir()
    for name, value in (("HF_HUB_CACHE", str(folder)), ("HF_HUB_OFFLINE", True)):
        monkeypatch.setenv(name, "1" if value is True else value)
        monkeypatch.setattr(constants, name, value)
    return folder


@pytest.fixture
def fetched(monkeypatch):
    """The files each ``snapshot_download`` call was asked for (its ``allow_patterns``), in order."""
    import huggingface_hub
    calls, real = [], huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        if kwargs.get("allow_patterns") is not None:
            calls.append(list(kwargs["allow_patterns"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    return calls


def publish(cache: Path, repo: str, files: Path) -> Path:
    """Lay the files under ``files`` into ``cache`` as huggingface_hub keeps a repo: each a blob named by its
    sha256, linked from the commit's snapshot under its path; ``refs/main`` names the commit."""
    store = cache / f"models--{repo.replace('/', '--')}"
    snapshot = store / "snapshots" / COMMIT
    for file in sorted(path for path in files.rglob("*") if path.is_file()):
        data = file.read_bytes()
        blob = store / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(files)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (store / "refs").mkdir(exist_ok=True)
    (store / "refs" / "main").write_text(COMMIT)
    return snapshot


def saelens_release(root: Path, d_in: int = 16) -> Path:
    """Two SAELens SAEs, each in the folder of its sae_id (its hook), as a release's repo holds them."""
    for seed, hook in enumerate(HOOKS, start=1):
        write_saelens(root / hook, d_in=d_in, d_sae=4 * d_in, architecture="topk", k=4, hook_name=hook, seed=seed)
    return root


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two dictionaries hold the same tensors (names, dtypes, values) and settings."""
    one, two = a.state_dict(), b.state_dict()
    return one.keys() == two.keys() and all(one[name].dtype == two[name].dtype and torch.equal(one[name], two[name])
                                            for name in one) and repr(a).split("source=")[0] == \
        repr(b).split("source=")[0]


def test_an_saelens_sae_by_repo_and_sae_id_is_the_one_from_its_folder(cache, tmp_path, fetched):
    release = saelens_release(tmp_path / "release")
    publish(cache, "org/saes", release)
    first, second = (SAE.load("org/saes", sae_id=hook) for hook in HOOKS)
    assert same(first, SAE.load(release / HOOKS[0])) and same(second, SAE.load(release / HOOKS[1]))
    assert not torch.equal(first.W_enc, second.W_enc) and (first.hook, second.hook) == (
        "layers.1.layer_output", "layers.2.layer_output")
    assert fetched == [[f"{hook}/cfg.json", f"{hook}/sae_weights.safetensors"] for hook in HOOKS]
    assert same(SAE.load(release, sae_id=HOOKS[1]), second)  # sae_id names the folder of a local path too
    assert same(SAE.load(str(release / HOOKS[0])), first)  # a local path that exists reads as before


def test_a_qwen_scope_layer_by_repo_takes_k_from_the_repos_name(cache, tmp_path, fetched):
    files = tmp_path / "qwen-scope"
    for layer in (0, 1):
        write_qwen_scope(files, layer=layer, d_in=16, d_sae=64, seed=layer)
    publish(cache, "Qwen/SAE-Res-Tiny-W64-L0_4", files)
    sae = SAE.load("Qwen/SAE-Res-Tiny-W64-L0_4", layer=1)
    assert same(sae, SAE.load(files, layer=1, k=4)) and sae.k == 4 and sae.hook == "layers.1.layer_output"
    assert fetched == [["layer1.sae.pt"]]  # the layer asked, not the other
    with pytest.raises(InvalidArgument, match=r"holds SAEs of layers 0, 1; layer=5 is not there: give layer="):
        SAE.load("Qwen/SAE-Res-Tiny-W64-L0_4", layer=5)
    with pytest.raises(InvalidArgument, match=r"layers 0, 1; no layer= was given"):
        SAE.load("Qwen/SAE-Res-Tiny-W64-L0_4")


def test_a_transcoder_set_by_repo_and_sae_id_fetches_the_layers_file(cache, tmp_path, fetched):
    files = tmp_path / "sets"
    write_transcoders(files / "relu", d_model=16, layers=3, d_transcoder=32, seed=0)
    listed = write_transcoders(files / "topk", d_model=16, layers=3, d_transcoder=32, activation="topk", k=4, seed=5)
    for i in range(3):  # a set whose config.yaml lists its files by hf:// address, under other names
        (listed / f"layer_{i}.safetensors").rename(listed / f"tc_{i}.safetensors")
    config = yaml.safe_load((listed / "config.yaml").read_text())
    config["transcoders"] = [f"hf://org/transcoders/topk/tc_{i}.safetensors" for i in range(3)]
    (listed / "config.yaml").write_text(yaml.safe_dump(config))
    publish(cache, "org/transcoders", files)
    relu = Transcoder.load("org/transcoders", layer=1, sae_id="relu")
    topk = Transcoder.load("org/transcoders", layer=2, sae_id="topk")
    assert same(relu, Transcoder.load(files / "relu", layer=1)) and relu.activation == "relu"
    assert same(topk, Transcoder.load(listed, layer=2)) and (topk.activation, topk.k, topk.layer) == ("topk", 4, 2)
    assert fetched == [["relu/config.yaml", "relu/layer_1.safetensors"], ["topk/config.yaml"],
                       ["topk/tc_2.safetensors"]]


def test_a_cross_layer_transcoder_by_repo_and_subfolder(cache, tmp_path, sdpa_model):
    files = tmp_path / "clts"
    tiny_clt(files / "clt" / "plain", sdpa_model, seed=0)
    tiny_clt(files / "clt" / "affine", sdpa_model, format="gemma-scope-2", jumprelu=True, skip=True, seed=1)
    publish(cache, "org/clts", files)  # the cache's links into its blobs are the folder's own files
    affine = CrossLayerTranscoder.load("org/clts", subfolder="clt/affine")
    local = CrossLayerTranscoder.load(files / "clt" / "affine")
    assert affine.state_dict().keys() == local.state_dict().keys() and affine.W_skip is not None
    assert all(torch.equal(tensor, local.state_dict()[name]) for name, tensor in affine.state_dict().items())
    plain = CrossLayerTranscoder.load("org/clts", subfolder="clt/plain", dtype=torch.float64)
    assert plain.W_skip is None and plain.W_enc[0].dtype == torch.float64
    with pytest.raises(MissingFile, match=r"org/clts/clt: no cross-layer transcoder there .*its folders holding a "
                                          r"cross-layer transcoder are clt/affine, clt/plain: give subfolder="):
        CrossLayerTranscoder.load("org/clts", subfolder="clt")


def test_what_is_missing_names_what_there_is(cache, tmp_path):
    publish(cache, "org/saes", saelens_release(tmp_path / "release"))
    with pytest.raises(MissingFile, match=r"org/saes/blocks.9.hook_resid_post: no SAE there \(as the local cache "
                                          r"holds it\); its folders holding an SAE are blocks.1.hook_resid_post, "
                                          r"blocks.2.hook_resid_post: give sae_id= one of them"):
        SAE.load("org/saes", sae_id="blocks.9.hook_resid_post")
    with pytest.raises(MissingFile, match=r"no local path 'org/elsewhere', and the Hub repository 'org/elsewhere' is "
                                          r"not in the local cache \(HF_HUB_OFFLINE is set; it holds org/saes\)"):
        SAE.load("org/elsewhere", sae_id="x")
    with pytest.raises(MissingFile, match=r"'org/saes' at revision 'v2' is not in the local cache"):
        SAE.load("org/saes", sae_id=HOOKS[0], revision="v2")
    with pytest.raises(MissingFile, match=r"org/saes: no cross-layer transcoder there .*it holds no cross-layer "
                                          r"transcoder qgraph reads: give subfolder="):
        CrossLayerTranscoder.load("org/saes")


def test_a_name_that_is_neither_a_path_nor_a_repo_id_names_both_readings(cache, tmp_path):
    with pytest.raises(MissingFile, match=r"nothing is at that local path, and it is no Hub repository id "
                                          r"\('org/repo'\); an SAELens release name .* is no repo id: pass the "
                                          r"release's repo_id and the SAE's folder"):
        SAE.load("gemma-scope-2b-pt-res-canonical")
    with pytest.raises(MissingFile, match=r"no transcoder at '.*/nowhere/set': nothing is at that local path"):
        Transcoder.load(str(tmp_path / "nowhere" / "set"), layer=0)
    with pytest.raises(InvalidArgument, match=r"revision='main' picks a version of a Hub repository"):
        SAE.load(saelens_release(tmp_path / "release") / HOOKS[0], revision="main")
    with pytest.raises(InvalidArgument, match=r"sae_id='../up': give a folder inside the repository"):
        SAE.load("org/saes", sae_id="../up")


def test_an_oversized_file_is_refused_unread(cache, tmp_path, monkeypatch):
    import safetensors.torch
    release = saelens_release(tmp_path / "release")
    publish(cache, "org/saes", release)
    weights = release / HOOKS[0] / "sae_weights.safetensors"

    def unread(*args, **kwargs):
        raise AssertionError("an oversized file was read")

    monkeypatch.setattr(safetensors.torch, "load_file", unread)
    monkeypatch.setattr(bounds, "WEIGHTS_BYTES", weights.stat().st_size - 1)
    limit = f"{weights.stat().st_size:,} bytes, past the {weights.stat().st_size - 1:,} qgraph reads"
    with pytest.raises(InvalidArgument, match=rf"org/saes/{HOOKS[0]}/sae_weights.safetensors: {limit}"):
        SAE.load("org/saes", sae_id=HOOKS[0])
    with pytest.raises(InvalidArgument, match=rf"sae_weights.safetensors: {limit} .*WEIGHTS_BYTES"):
        SAE.load(release / HOOKS[0])  # the local reader applies the same bound
    monkeypatch.setattr(bounds, "SETTINGS_BYTES", 10)
    with pytest.raises(InvalidArgument, match=r"cfg.json: \d+ bytes, past the 10 .*SETTINGS_BYTES"):
        SAE.load(release / HOOKS[0])


def test_online_the_layouts_files_are_downloaded_after_the_hubs_sizes_are_checked(cache, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import HfApi, constants
    from huggingface_hub.hf_api import RepoFile
    release = saelens_release(tmp_path / "release")
    snapshot = publish(cache, "org/saes", release)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    sizes = {path.relative_to(release).as_posix(): path.stat().st_size for path in release.rglob("*") if path.is_file()}
    monkeypatch.setattr(HfApi, "list_repo_tree", lambda self, repo, **kwargs: iter(
        [RepoFile(path=path, size=size, oid="x") for path, size in sizes.items()]))
    calls = []

    def download(repo, **kwargs):  # the Hub stood in for: what the call asks for, and the files it would fetch
        calls.append((repo, kwargs))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    assert same(SAE.load("org/saes", sae_id=HOOKS[1], revision="v1"), SAE.load(release / HOOKS[1]))
    assert calls == [("org/saes", {"revision": "v1", "allow_patterns": [f"{HOOKS[1]}/cfg.json",
                                                                        f"{HOOKS[1]}/sae_weights.safetensors"],
                                   "local_files_only": False})]
    sizes[f"{HOOKS[0]}/sae_weights.safetensors"] = 200 << 30  # the Hub says so: refused before the download
    with pytest.raises(InvalidArgument, match=rf"org/saes/{HOOKS[0]}/sae_weights.safetensors: 214,748,364,800 bytes, "
                                              rf"past the 68,719,476,736"):
        SAE.load("org/saes", sae_id=HOOKS[0])
    assert len(calls) == 1


def test_the_hub_out_of_reach_falls_back_to_the_cache(cache, tmp_path, monkeypatch):
    from huggingface_hub import HfApi, constants
    release = saelens_release(tmp_path / "release")
    publish(cache, "org/saes", release)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def unreachable(self, repo, **kwargs):
        raise ConnectionError("no route to the Hub")

    monkeypatch.setattr(HfApi, "list_repo_tree", unreachable)
    assert same(SAE.load("org/saes", sae_id=HOOKS[1]), SAE.load(release / HOOKS[1]))
    with pytest.raises(MissingFile, match=r"not in the local cache \(the Hub could not be reached: ConnectionError: "
                                          r"no route to the Hub; it holds org/saes\)"):
        SAE.load("org/other", sae_id=HOOKS[1])


def test_an_sae_by_name_splices_as_the_one_by_path(cache, tmp_path, sdpa_model):
    release = saelens_release(tmp_path / "release", d_in=sdpa_model.config.hidden_size)
    publish(cache, "org/saes", release)
    ids, values = random_ids(1, 6, seed=3), ["layers.1.sae.features", "layers.1.sae.reconstruction"]
    by_name = qgraph.instrument(sdpa_model, values=values, saes={"layers.1.layer_output": SAE.load(
        "org/saes", sae_id=HOOKS[0])})(ids)
    by_path = qgraph.instrument(sdpa_model, values=values, saes={"layers.1.layer_output": SAE.load(
        release / HOOKS[0])})(ids)
    assert by_name["layers.1.sae.features"].count_nonzero() > 0
    for name in values:
        assert torch.equal(by_name[name], by_path[name])
    assert torch.equal(by_name.logits, by_path.logits)
    shutil.rmtree(release)  # the cache's copy is its own
    assert same(SAE.load("org/saes", sae_id=HOOKS[0]), SAE.load(cache / "models--org--saes" / "snapshots" / COMMIT /
                                                                 HOOKS[0]))
