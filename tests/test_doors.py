"""One instrument behind every door: a local instrument, a remote one (the session's server on the same
checkpoint) and a loaded program are each a ``qgraph.Instrument``; a name selects the same values in the
same order on each, the values are equal, and the recipes and pictures run on each and agree."""
from __future__ import annotations

import pytest
import torch

import qgraph
from tests.pages import hover_grids

# every kind of name a researcher writes: standard names, globs over blocks and over a module's values,
# negative block indices, the bracket form, TransformerLens and HF names
NAMES = ["layers.*.layer_output", "layers.-1.mlp.mlp_output", "layers[1].layer_mid", "blocks.*.hook_resid_post",
         "blocks.2.hook_attn_out", "model.layers.0.mlp.output", "layers.*.linear_attn.*", "layers.3.self_attn.*",
         "**.mlp_neurons", "layers.*.mlp.down_proj.input"]
PICTURED = ["layers.3.self_attn.attention_probabilities", "layers.0.linear_attn.effective_attention",
            "layers.1.linear_attn.decays", "layers.*.layer_output"]  # the figures each door draws
SAVED = ["layers.*.layer_output", "layers.*.layer_mid", "layers.*.mlp.mlp_output", "blocks.2.hook_attn_out"]


def three_doors(model, remote, folder, values) -> dict:
    """A local instrument of ``values`` (slots at every block's output), the server's, and the local one saved
    with its weights and loaded."""
    local = qgraph.instrument(model, values=values, edits=["layers.*.layer_output"])
    path = local.save(folder / "doors.qgraph", weights=True)
    return {"local": local, "remote": remote.instrument(values, edits=["layers.*.layer_output"]),
            "loaded": qgraph.load(path)}


@pytest.fixture(scope="module")
def doors(sdpa_model, remote, tmp_path_factory):
    return three_doors(sdpa_model, remote, tmp_path_factory.mktemp("doors"), SAVED)


@pytest.fixture(scope="module")
def picture_doors(sdpa_model, remote, tmp_path_factory):
    """The three doors to an instrument of the values ``PICTURED`` draws (slots for the lens and patching)."""
    return three_doors(sdpa_model, remote, tmp_path_factory.mktemp("pictures"), PICTURED)


def ids(seed: int, seq: int = 5) -> torch.Tensor:
    return torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seed))


def close(a, b, tol=1e-4):
    assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), (a - b).abs().max()


def test_every_door_is_an_instrument_and_names_select_the_same_values(doors):
    local, remote, loaded = doors["local"], doors["remote"], doors["loaded"]
    for door in doors.values():
        assert isinstance(door, qgraph.Instrument) and door.blocks == 4 and door.family is local.family
    for name in NAMES:
        assert remote.resolve(name) == local.resolve(name), name
        # a saved program knows only its values and slots: among them, the same selection
        mine = [n for n in local.resolve(name) if n in loaded.catalogue]
        assert (loaded.resolve(name) if mine else []) == mine, name
    assert local.resolve("layers.*.linear_attn.*")[:2] == ["layers.0.linear_attn.attention_queries",
                                                           "layers.0.linear_attn.attention_keys"]
    assert "layers.0.linear_attn.states" not in remote.resolve("layers.*.linear_attn.*")  # by name only
    assert not any(remote.catalogue[name].port for name in remote.resolve("layers.*.linear_attn.*"))  # no ports
    assert remote.catalogue["layers.0.mlp.output"].port and remote.resolve("layers.0.mlp.*put")
    with pytest.raises(qgraph.UnknownValue, match="there is no block 7"):
        remote.resolve("layers.7.layer_output")
    assert local.values == remote.values == loaded.values


def test_values_are_equal_through_every_door(doors):
    outs = {door: instrument(ids(1)) for door, instrument in doors.items()}
    for name in doors["local"].values:
        close(outs["remote"][name], outs["local"][name])
        close(outs["loaded"][name], outs["local"][name])
    for out in outs.values():  # TransformerLens names read the values on every door
        assert torch.equal(out["blocks.1.hook_resid_post"], out["layers.1.layer_output"])
    close(outs["remote"].logits, outs["local"].logits)


def test_every_door_keeps_the_calls_mask_and_edits_on_its_output(doors):
    """What a picture leaves out as pads and a decomposition reruns the call with: the call's attention mask and
    its edits, on every door's output."""
    tokens, mask = ids(4, seq=6).repeat(2, 1), torch.ones(2, 6, dtype=torch.long)
    mask[1, :3] = 0
    edits = {"layers.1.layer_output": qgraph.Zero(positions=[-1])}
    for door, instrument in doors.items():
        out = instrument(tokens, mask, edits=edits)
        assert torch.equal(out.attention_mask, mask), door
        assert out.edits == edits, door


def test_patch_and_pictures_agree_through_every_door(doors):
    metric = lambda logits: logits[:, -1, 3].sum() - logits[:, -1, 7].sum()  # noqa: E731
    patched = {door: qgraph.patch(instrument, ids(2), ids(3), "layers.*.layer_output", metric, positions="each")
               for door, instrument in doors.items()}
    for name, effect in patched["local"].items():
        assert effect.abs().sum() > 0
        close(patched["remote"][name], effect)
        close(patched["loaded"][name], effect)
    pages = {}
    for door, instrument in doors.items():
        out = instrument(ids(4))
        figure = out.plot("layers.*.layer_output")  # the residual stream's norm, blocks x tokens
        assert "svg" in figure.formats and "<svg" in figure.svg
        pages[door] = qgraph.explore(instrument, out).to_html()
        assert 'data-value="layers.3.layer_output"' in pages[door] and "Residual [batch seq hidden_size]" in pages[door]
    assert "<svg" in pages["local"] and "runs elsewhere" in pages["remote"] and "runs elsewhere" in pages["loaded"]


def test_attribution_and_the_lens_agree_on_every_door(doors, sdpa_model, tmp_path):
    local = doors["local"]
    before = {name: tensor.clone() for name, tensor in sdpa_model.state_dict().items()}
    grads = [None if weight.grad is None else weight.grad.clone() for weight in sdpa_model.parameters()]
    metric = lambda logits: logits[:, -1, 3].sum()  # noqa: E731
    theirs = qgraph.attribution_patch(local, ids(5), ids(6), "layers.*.layer_output", metric, positions="each")
    for door in ("remote", "loaded"):
        mine = qgraph.attribution_patch(doors[door], ids(5), ids(6), "layers.*.layer_output", metric, positions="each")
        for name in theirs:
            close(mine[name], theirs[name])
    assert theirs["layers.1.layer_output"].abs().sum() > 0
    loaded = doors["loaded"]
    for weight, grad in zip(sdpa_model.parameters(), grads):  # no weight's gradient, the model as it was
        assert (weight.grad is None) if grad is None else torch.equal(weight.grad, grad)
    assert all(torch.equal(tensor, before[name]) for name, tensor in sdpa_model.state_dict().items())
    ref = local.logit_lens(ids(5), positions=[0, -1], top=3)
    for door in ("remote", "loaded"):
        lens = doors[door].logit_lens(ids(5), positions=[0, -1], top=3)
        assert lens.positions == ref.positions == [0, 4]
        for block in ref:
            assert torch.equal(lens[block][0], ref[block][0])
            close(lens[block][1], ref[block][1])
    close(loaded.project_on_vocab(local(ids(7))["layers.3.layer_output"]), local(ids(7)).logits)
    bare = qgraph.load(local.variant(["layers.*.layer_output"]).save(tmp_path / "bare.qgraph", weights=True))
    with pytest.raises(qgraph.NotSupported, match="needs a slot at layers.3.layer_output"):
        bare.logit_lens(ids(5))
    with pytest.raises(qgraph.NotSupported, match="generate with qgraph.instrument"):
        loaded.generate(ids(5), max_new_tokens=2)
    with pytest.raises(qgraph.NotSupported, match="saved without layers.1.layer_mid among its values and slots"):
        loaded.variant((), edits=["layers.1.layer_mid"])
    with pytest.raises(qgraph.UnknownValue, match="Unknown value 'layers.1.linear_attn.attention_queries'"):
        loaded.variant(["layers.1.linear_attn.attention_queries"])  # not among what it was saved with



def test_the_lens_grid_its_logits_and_its_picture_agree_on_every_door(doors, tokenizer):
    """positions="all" (the default) and logits=True: the same grid, logits and figure through every door,
    a left-padded row's pads included."""
    tokens = ids(8, seq=6).repeat(2, 1)
    mask = torch.ones_like(tokens)
    mask[1, :2] = 0
    ref = doors["local"].logit_lens(tokens, mask, top=3, logits=True)
    assert ref.top_ids.shape == (2, 4, 6, 3) and ref.logits.shape[:3] == (2, 4, 6)
    for door in ("remote", "loaded"):
        lens = doors[door].logit_lens(tokens, mask, top=3, logits=True)
        assert lens.positions == ref.positions == list(range(6))
        assert torch.equal(lens.top_ids, ref.top_ids)
        close(lens.top_probs, ref.top_probs)
        close(lens.logits, ref.logits)
        assert torch.equal(lens.attention_mask, mask)
        figure, theirs = lens.plot(tokenizer, batch=1), ref.plot(tokenizer, batch=1)  # a server's has no tokenizer here
        assert figure.data["positions"] == theirs.data["positions"] == [2, 3, 4, 5]
        assert torch.equal(figure.data["ids"], theirs.data["ids"]) and figure.data["labels"] == theirs.data["labels"]
        with pytest.raises(qgraph.NotCaptured, match="logits=True"):
            doors[door].logit_lens(tokens, positions=[-1]).logits

def test_figures_draw_the_same_through_every_door(picture_doors, tokenizer):
    """A remote and a loaded output plot as a local one (the layouts travel with the catalogue): the same
    numbers, tokens, titles, colour scales and hover cells, for values, the lens and a patching sweep."""
    call = ids(9, seq=7)
    metric = lambda logits: logits[:, -1, 3].sum() - logits[:, -1, 7].sum()  # noqa: E731
    figures = {}
    for door, instrument in picture_doors.items():
        out = instrument(call)
        made = {name: out.plot(name, tokenizer=tokenizer) for name in PICTURED}
        made["lens"] = instrument.logit_lens(call).plot(tokenizer)
        made["patch"] = qgraph.patch(instrument, ids(2), ids(3), "layers.*.layer_output", metric,
                                     positions=[0, -1]).plot(tokenizer=tokenizer)
        figures[door] = made
    for door in ("remote", "loaded"):
        for what, mine in figures["local"].items():
            theirs = figures[door][what]
            assert theirs.title == mine.title and theirs.matplotlib.get_suptitle() == mine.matplotlib.get_suptitle()
            assert theirs.data.keys() == mine.data.keys(), what
            for key, value in mine.data.items():
                if key == "grids":  # a patching sweep's: a tensor per value
                    for a, b in zip(theirs.data[key], value, strict=True):
                        close(a, b)
                elif isinstance(value, torch.Tensor):
                    close(theirs.data[key].nan_to_num(7.0), value.nan_to_num(7.0))
                elif key == "limits":
                    assert theirs.data[key] == pytest.approx(value, abs=1e-4), (door, what)
                else:
                    assert theirs.data[key] == value, (door, what, key)
            for a, b in zip(hover_grids(theirs._repr_html_()), hover_grids(mine._repr_html_()), strict=True):
                assert (a["rows"], a["columns"], a["panel"]) == (b["rows"], b["columns"], b["panel"])
                assert [c == "-" for c in a["cells"]] == [c == "-" for c in b["cells"]]
                close(torch.tensor([float(c) for c in a["cells"] if c != "-"]),
                      torch.tensor([float(c) for c in b["cells"] if c != "-"]), tol=1e-2)  # 3 digits each
    loaded = picture_doors["loaded"](call).plot(PICTURED[0])  # a saved program's folder has the tokenizer: no tokenizer=
    assert loaded.data["tokens"] == figures["local"][PICTURED[0]].data["tokens"]


@pytest.mark.parametrize("served, named", [("Qwen/Qwen3.5-0.8B", "Qwen/Qwen3.5-0.8B"), ("tiny-qwen3_5", "")])
def test_a_server_names_its_hub_model_so_pictures_find_its_tokenizer(url, served, named):
    """A hub id the server sends becomes the remote config's name (the Hugging Face cache holds its tokenizer);
    a folder, sent by its last part alone, names nothing (``tokenizer=`` labels its tokens)."""
    from tests.serving import KEY
    server = qgraph.remote(url, api_key=KEY)
    info = server.info()
    server._info = {**info, "model": {**info["model"], "name": served}}  # what a server of that model sends
    assert server.instrument(["layers.1.layer_output"]).config._name_or_path == named


def test_a_capture_through_every_door_holds_the_same_values(doors, tokenizer, tmp_path):
    texts = ["The Eiffel Tower is in Paris.", "A second, shorter document.", "Three."]
    runs = {door: qgraph.capture(doors[door], tokenizer, texts, ["layers.1.layer_output", "layers.3.layer_output"],
                                 tmp_path / door, context=8, batch_size=2, dtype=torch.float32, progress=False)
            for door in ("local", "remote", "loaded")}  # (a model's own capture: tests/test_capture.py)
    captured = {door: qgraph.load_capture(run.out) for door, run in runs.items()}
    reference = captured["local"]
    for door, capture in captured.items():
        assert runs[door].rows == runs["local"].rows == len(capture) > 1
        for row in range(len(capture)):
            for name in ("layers.1.layer_output", "layers.3.layer_output", "input_ids"):
                close(capture[row][name], reference[row][name])
    assert runs["remote"].manifest["identity"]["model"]["weights_sha256"] == \
        runs["local"].manifest["identity"]["model"]["weights_sha256"]  # the server hashes the same weights
    with pytest.raises(qgraph.InvalidArgument, match="an instrument given has its own"):
        qgraph.capture(doors["local"], tokenizer, texts, ["layers.1.layer_output"], tmp_path / "x", compile=True)


@pytest.mark.parametrize("change", ["a fact of another type", "an unknown fact", "another family's model type",
                                    "a dunder config field"])
def test_a_catalogue_the_client_cannot_read_is_refused_before_any_use(remote, monkeypatch, change):
    import copy

    from qgraph.serve.client import Remote
    info = copy.deepcopy(remote.info())
    entry = info["values"]["layers.0.layer_output"]
    if change == "a fact of another type":
        entry["port"] = "yes"
    elif change == "an unknown fact":
        entry["__class__"] = "x"
    elif change == "another family's model type":
        info["model"]["model_type"] = "llama"
    else:
        info["model"]["config"]["__class__"] = "x"
    hostile = qgraph.remote(remote.url)
    monkeypatch.setattr(Remote, "info", lambda self: info)
    with pytest.raises((qgraph.NotSupported, qgraph.InvalidArgument), match="this qgraph does not (read|know)|no field"):
        hostile.instrument(["layers.0.layer_output"])
