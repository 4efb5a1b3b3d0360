"""``out.plot``, ``ig.logit_lens(...).plot()`` and ``qgraph.Figure`` (issue 28) on the tiny model: each plot
kind checked on the numbers it drew (``fig.data``, against the captured tensors) and on its SVG (one panel
per head, the tokens as tick labels), every page offline, and the mistakes named."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest
import torch

import qgraph
from qgraph.errors import InvalidArgument, InvalidType, MissingFile, NotCaptured, NotSupported, OutOfRange
from qgraph.output import Output
from qgraph.saes import SAE
from qgraph.saes.fixtures import weights

ATTN, DELTA = "layers.3.self_attn", "layers.0.linear_attn"
PROMPTS = ["the cat sat", "my dog ran!"]  # 11 byte tokens each
NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def ig_plots(sdpa_model):
    w = weights(sdpa_model.config.hidden_size, 96, seed=3)
    sae = SAE(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], "relu")
    return qgraph.instrument(sdpa_model, saes={"layers.1.layer_output": sae}, values=[
        f"{ATTN}.attention_probabilities", f"{ATTN}.attention_scores", f"{DELTA}.decays", f"{DELTA}.betas",
        f"{DELTA}.states", f"{DELTA}.state_output", "layers.*.layer_output", "layers.1.sae.features",
        "layers.1.mlp.down_proj.input", f"{DELTA}.effective_attention", "layers.2.mlp.mlp_neurons"])  # test_figures too


@pytest.fixture(scope="module")
def run(ig_plots, tokenizer):
    ids = tokenizer(PROMPTS, return_tensors="pt").input_ids
    assert ids.shape == (2, 11)
    return ids, ig_plots(ids)


def texts(svg: str) -> list[str]:
    """Every text of a matplotlib SVG (qgraph draws real text, not glyph paths)."""
    return [t.text for t in ET.fromstring(svg).iter(f"{NS}text") if t.text]


def panels(svg: str) -> int:
    return len(re.findall(r'<g id="axes_\d+">', svg))


def offline(page: str) -> None:
    assert not re.findall(r"https?://", page), "an inline page names no URL (not even a namespace)"
    assert not re.search(r"<script[^>]*\ssrc=|<link\b|@import|url\((?!#)|<iframe", page)


def shown(name: str) -> list[str]:
    """The token labels as qgraph shows them (a space as ␣)."""
    return ["␣" if c == " " else c for c in name]


# -- attention patterns ---------------------------------------------------------------------------------
def test_pattern_has_one_panel_per_head_labelled_with_the_tokens(run):
    ids, out = run
    labels = [f"w{i}x" for i in range(11)]
    fig = out.plot(f"{ATTN}.attention_probabilities", tokens=labels, batch=1)
    assert isinstance(fig, qgraph.Figure)
    assert panels(fig.svg) == 4 + 1  # num_attention_heads: one query × key panel each, and their colour bar
    assert torch.equal(fig.data["pattern"], out[f"{ATTN}.attention_probabilities"][1].detach())
    drawn = texts(fig.svg)
    assert all(drawn.count(label) == 2 * 4 for label in labels)  # each on both axes of every panel
    assert {f"head {h}" for h in range(4)} <= set(drawn)
    offline(fig._repr_html_())
    # by default the call's own tokens, decoded by the model's tokenizer (found in its folder)
    default = out.plot(f"{ATTN}.attention_probabilities")
    assert default.data["tokens"] == shown(PROMPTS[0])
    assert default.svg.count(">␣</text>") == 2 * 2 * 4  # the two spaces, on both axes of every panel


def test_pattern_heads_and_scores(run):
    _, out = run
    fig = out.plot(f"{ATTN}.attention_scores", heads=[3, 1])
    assert panels(fig.svg) == 2 + 1 and fig.data["heads"] == [3, 1] and {"head 3", "head 1"} <= set(texts(fig.svg))
    scores = out[f"{ATTN}.attention_scores"][0, [3, 1]].detach()
    finite = torch.isfinite(scores)
    assert torch.equal(fig.data["pattern"][finite], scores[finite])
    assert torch.isnan(fig.data["pattern"][~finite]).all()  # masked keys are left blank, not -inf


def test_vision_patterns_plot_per_image():
    patterns = [torch.rand(2, 4, 4), torch.rand(2, 6, 6)]  # the vision tower's: one [heads, patches, patches] per image
    name = "vision.layers.0.self_attn.attention_probabilities"
    layout = "Pattern [images] x [vision_num_heads patches_j patches_j]"
    source = SimpleNamespace(catalogue={name: SimpleNamespace(layout=layout, description="")})
    out = Output(None, {name: patterns}, 4, source=source)
    fig = out.plot(name, image=1)
    assert panels(fig.svg) == 2 + 1 and torch.equal(fig.data["pattern"], patterns[1])  # two heads, one colour bar
    assert fig.data["tokens"] == [str(i) for i in range(6)]  # patches are numbered
    with pytest.raises(OutOfRange, match="image=2"):
        out.plot(name, image=2)


# -- DeltaNet -------------------------------------------------------------------------------------------
def test_decays_and_betas_are_heads_by_tokens(run):
    _, out = run
    for part in ("decays", "betas"):
        fig = out.plot(f"{DELTA}.{part}", batch=1)
        assert torch.equal(fig.data["grid"], out[f"{DELTA}.{part}"][1].detach().T)  # [heads, tokens]
        assert fig.data["tokens"] == shown(PROMPTS[1])
        assert panels(fig.svg) == 2  # the heatmap and its colour bar
        assert {f"head {h}" for h in range(4)} <= set(texts(fig.svg))


def test_states_norm_per_head_over_tokens_and_one_heads_matrix(run):
    _, out = run
    states = out[f"{DELTA}.states"][0].detach()  # [seq, heads, key_dim, value_dim]
    fig = out.plot(f"{DELTA}.states", head=2, position=3)
    torch.testing.assert_close(fig.data["norms"], states.flatten(-2).norm(dim=-1).T)
    assert torch.equal(fig.data["matrix"], states[3, 2])
    assert "head 2's state after token 3 (␣)" in texts(fig.svg)
    last = out.plot(f"{DELTA}.state_output")  # no token axis: a bar per head, and head 0's matrix
    final = out[f"{DELTA}.state_output"][0].detach()
    torch.testing.assert_close(last.data["norms"], final.flatten(-2).norm(dim=-1))
    assert torch.equal(last.data["matrix"], final[0])
    torch.testing.assert_close(last.data["norms"], fig.data["norms"][:, -1])  # the state after the last token


# -- the residual stream and SAE features ---------------------------------------------------------------
def test_residual_norm_per_token_and_blocks_by_tokens_for_a_glob(run):
    _, out = run
    one = out.plot("layers[-2].layer_output")
    torch.testing.assert_close(one.data["norm"], out["layers.2.layer_output"][0].detach().norm(dim=-1))
    grid = out.plot("layers.*.layer_output", batch=1)
    assert grid.data["grid"].shape == (4, 11)  # blocks × tokens
    for block in range(4):
        torch.testing.assert_close(grid.data["grid"][block], out[f"layers.{block}.layer_output"][1].detach().norm(dim=-1))
    assert grid.data["rows"] == [f"layers.{block}" for block in range(4)]
    assert {f"layers.{block}" for block in range(4)} <= set(texts(grid.svg))


def test_sae_features_top_per_token(run):
    _, out = run
    acts = out["layers.1.sae.features"][0].detach()
    fig = out.plot("layers.1.sae.features", top=3, rows=1000)
    assert torch.equal(fig.data["top"], acts.topk(3, dim=-1).indices)
    assert set(fig.data["features"].tolist()) == set(fig.data["top"].flatten().tolist())  # every token's top 3
    assert torch.equal(fig.data["grid"], acts[:, fig.data["features"]].T)
    assert f"feature {int(fig.data['features'][0])}" in texts(fig.svg)
    capped = out.plot("layers.1.sae.features", top=3, rows=2)
    assert torch.equal(capped.data["features"], fig.data["features"][:2])  # the most active first


def test_logit_lens_plots_blocks_by_positions_of_top_tokens(ig_plots, run, tokenizer):
    ids, _ = run
    lens = ig_plots.logit_lens(ids, positions=[0, -1], top=3)
    assert isinstance(lens, dict) and sorted(lens) == [0, 1, 2, 3] and lens.positions == [0, 10]
    fig = lens.plot(batch=1)
    for block in range(4):
        top = lens[block][0][1, :, 0]
        assert torch.equal(fig.data["ids"][block], top)
        assert fig.data["tokens"][block] == [repr(tokenizer.decode([int(i)]))[1:-1].replace(" ", "␣") for i in top]
    assert {"block 0", "block 3", "0: m", "10: !"} <= set(texts(fig.svg))



def test_the_lens_grid_plots_every_position_with_its_top_token_and_a_colour_scale(ig_plots, run, tokenizer):
    ids, _ = run
    lens = ig_plots.logit_lens(ids)  # every position: the grid
    fig = lens.plot()
    shown = lambda tokens: [repr(tokenizer.decode([int(i)]))[1:-1].replace(" ", "␣") for i in tokens]  # noqa: E731
    assert fig.data["positions"] == list(range(11)) and torch.equal(fig.data["ids"], lens.top_ids[0, :, :, 0])
    torch.testing.assert_close(fig.data["probabilities"], lens.top_probs[0, :, :, 0])
    assert fig.data["labels"] == shown(ids[0])  # the whole row: its tokens label the x axis
    words = texts(fig.svg)
    assert "top-1 probability" in words and "block 3" in words
    cells = [cell for block in range(4) for cell in shown(lens.top_ids[0, block, :, 0])]
    assert fig.data["tokens"] == [shown(lens.top_ids[0, block, :, 0]) for block in range(4)]
    assert sum(words.count(cell) for cell in set(cells)) >= len(cells)  # each cell's token is written in it
    assert panels(fig.svg) == 1 + 1  # 11 positions: one line, and the colour bar


def test_a_long_lens_wraps_into_lines_of_legible_cells_and_a_longer_one_is_compact(ig_plots):
    ids = torch.randint(0, 256, (1, 140), generator=torch.Generator().manual_seed(1))
    lens = ig_plots.logit_lens(ids[:, :70])
    wrapped = lens.plot()
    assert wrapped.data["ids"].shape == (4, 70) and panels(wrapped.svg) == 3 + 1  # 70 positions: 3 lines of 24
    assert {"positions 0–23", "positions 24–47", "positions 48–69"} <= set(texts(wrapped.svg))
    drawn = texts(wrapped.svg)
    cells = [cell if len(cell) <= 7 else cell[:6] + "…" for row in wrapped.data["tokens"] for cell in row]
    assert sum(drawn.count(cell) for cell in set(cells)) >= len(cells)  # every cell holds its token's text
    assert max(wrapped.matplotlib.get_size_inches()) < 15  # each line sized to its cells, not a 26-inch strip
    compact = ig_plots.logit_lens(ids).plot()  # past 128 positions: one grid, no text in the cells
    assert compact.data["ids"].shape == (4, 140) and panels(compact.svg) == 1 + 1 and len(texts(compact.svg)) < 120

# -- saving and mistakes --------------------------------------------------------------------------------
def test_figure_saves_html_svg_and_png(run, tmp_path):
    _, out = run
    fig = out.plot(f"{DELTA}.betas")
    page = fig.save(tmp_path / "b.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    offline(page)
    assert ET.parse(fig.save(tmp_path / "b.svg")).getroot().tag == f"{NS}svg"
    assert fig.save(tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(InvalidArgument, match=r"saves as \.html or \.svg or \.png, not .b\.pdf."):
        fig.save(tmp_path / "b.pdf")
    with pytest.raises(MissingFile):
        fig.save(tmp_path / "no" / "b.svg")


def test_plot_mistakes_are_named(run):
    _, out = run
    with pytest.raises(NotCaptured, match="'layers.2.linear_attn.decays' was not captured"):
        out.plot("layers.2.linear_attn.decays")
    with pytest.raises(NotSupported, match="has no plot; these layouts plot: Pattern") as port:
        out.plot("layers.1.mlp.down_proj.input")
    assert "Gates" in str(port.value) and "Features" in str(port.value)
    with pytest.raises(NotSupported, match="a glob plots residual-stream values"):
        out.plot("layers.*.linear_attn.*")
    with pytest.raises(InvalidArgument, match=r"\['head'\] are not for a Pattern value"):
        out.plot(f"{ATTN}.attention_probabilities", head=1)
    with pytest.raises(OutOfRange, match="batch=2"):
        out.plot(f"{DELTA}.decays", batch=2)
    with pytest.raises(InvalidArgument, match="3 labels for 11 token positions"):
        out.plot(f"{DELTA}.decays", tokens=["a", "b", "c"])
    with pytest.raises(InvalidType):
        out.plot(f"{DELTA}.decays", tokens="abc")
