"""Figures that answer a hover (issue 57, item 1), on the tiny model: every figure qgraph draws has a colour
scale (diverging and symmetric about zero for a signed value), saves as .png, .svg and .html, and its HTML
carries, for each cell, the number qgraph computed there (3 significant digits) with its row and column
labels (query and key tokens, head, block, feature); in headless Chromium, hovering a cell shows them."""
from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

import qgraph
from tests.pages import browser, console_errors, hover, hover_grids as grids  # noqa: F401 - browser is a fixture
from tests.test_plots import ATTN, DELTA, PROMPTS, ig_plots, run  # noqa: F401 - ig_plots and run are fixtures

PNG = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parent.parent


def metric(logits):
    return logits[:, -1, 3].sum() - logits[:, -1, 7].sum()


# every figure qgraph draws, made from the module's call: (instrument, ids, output) -> Figure
FIGURES = {
    "pattern": lambda ig, ids, out: out.plot(f"{ATTN}.attention_probabilities", batch=1),
    "effective attention": lambda ig, ids, out: out.plot(f"{DELTA}.effective_attention"),
    "decays": lambda ig, ids, out: out.plot(f"{DELTA}.decays"),
    "betas": lambda ig, ids, out: out.plot(f"{DELTA}.betas"),
    "states": lambda ig, ids, out: out.plot(f"{DELTA}.states", head=1),
    "state output": lambda ig, ids, out: out.plot(f"{DELTA}.state_output"),
    "residual norm": lambda ig, ids, out: out.plot("layers.2.layer_output"),
    "residual grid": lambda ig, ids, out: out.plot("layers.*.layer_output"),
    "SAE features": lambda ig, ids, out: out.plot("layers.1.sae.features", top=3),
    "neurons": lambda ig, ids, out: out.plot("layers.2.mlp.mlp_neurons"),
    "lens": lambda ig, ids, out: ig.logit_lens(ids).plot(),
    "logit attribution": lambda ig, ids, out: out.logit_attribution(65, positions=[-2, -1]).plot(),
    "logit attribution, one position": lambda ig, ids, out: out.logit_attribution(65, positions=-1).plot(),
    "patching": lambda ig, ids, out: qgraph.patch(ig, ids[:1], ids[1:], "layers.*.layer_output", metric,
                                                  positions="each").plot(),
    "attribution patching": lambda ig, ids, out: qgraph.attribution_patch(ig, ids[:1], ids[1:], "layers.*.layer_output",
                                                                          metric, positions="each").plot(),
}


def at(grid: dict, row: int, column: int) -> str:
    return grid["cells"][row * len(grid["columns"]) + column]


def offline(page: str) -> None:
    assert not re.findall(r"https?://", page), "an inline page names no URL (not even a namespace)"
    assert not re.search(r"<script[^>]*\ssrc=|<link\b|@import|url\((?!#)|<iframe", page)


@pytest.mark.parametrize("kind", list(FIGURES))
def test_every_figure_has_a_colour_scale_and_saves_as_png_svg_and_html(ig_plots, run, tmp_path, kind):
    ids, out = run
    fig = FIGURES[kind](ig_plots, ids, out)
    assert fig.formats == ("html", "svg", "png")
    assert fig.save(tmp_path / "f.png").read_bytes()[:8] == PNG
    assert ET.parse(fig.save(tmp_path / "f.svg")).getroot().tag == "{http://www.w3.org/2000/svg}svg"
    page = fig.save(tmp_path / "f.html").read_text()
    offline(page)
    assert page.count('class="qg-hit"') == len(grids(page)) >= 1  # a hit rect per grid
    for grid in grids(page):
        assert len(grid["cells"]) == len(grid["rows"]) * len(grid["columns"])
        assert all(cell == "-" or float(cell) == float(cell) for cell in grid["cells"])
    assert fig._repr_html_() in page and 'class="qg-tip"' in page
    images = [image for axes in fig.matplotlib.axes for image in axes.images]
    bars = [axes for axes in fig.matplotlib.axes if axes.get_label() == "<colorbar>"]
    scales = {tuple(float(end) for end in image.get_clim()) for image in images}
    assert {tuple(float(end) for end in bar.get_ylim()) for bar in bars} == scales  # each heatmap's scale has a bar
    if images:  # the figure says the scale it drew with
        assert fig.data["limits"] in scales


def test_a_pattern_cell_in_the_html_carries_the_tensors_value_and_its_tokens(run):
    _, out = run
    fig = out.plot(f"{ATTN}.attention_probabilities", batch=1, heads=[2, 0])
    pattern = out[f"{ATTN}.attention_probabilities"][1].detach()
    data = grids(fig._repr_html_())
    assert [grid["panel"] for grid in data] == ["head 2", "head 0"]
    tokens = ["␣" if c == " " else c for c in PROMPTS[1]]
    for grid, head in zip(data, (2, 0)):
        assert grid["rows"] == [f"query {i}: {t}" for i, t in enumerate(tokens)]
        assert grid["columns"] == [f"key {j}: {t}" for j, t in enumerate(tokens)]
        for i, j in [(0, 0), (5, 3), (10, 10), (10, 0), (7, 6)]:
            assert at(grid, i, j) == format(float(pattern[head, i, j]), ".3g")
        assert grid["top"] and not grid["flipped"]  # query 0 at the top, key 0 at the left
    assert fig.data["limits"] == (0.0, float(pattern[[2, 0]].max()))  # probabilities: from zero
    assert "block 3" in fig.matplotlib.get_suptitle() and "heads 2, 0" in fig.matplotlib.get_suptitle()


def test_a_signed_value_is_drawn_diverging_and_symmetric_about_zero(run):
    _, out = run
    fig = out.plot(f"{DELTA}.effective_attention")
    value = out[f"{DELTA}.effective_attention"][0].detach()  # [heads, query, key]
    lower = value.masked_fill(torch.ones(11, 11, dtype=torch.bool).triu(1), float("nan"))
    assert (lower < 0).any() and (lower > 0).any()  # the delta rule removes: both signs are there
    bound = float(lower.nan_to_num(0).abs().max())
    assert fig.data["limits"] == (-bound, bound)
    image = fig.matplotlib.axes[0].images[0]
    assert image.cmap.name.startswith("RdBu_r") and image.get_clim() == (-bound, bound)
    data = grids(fig._repr_html_())
    assert at(data[1], 4, 2) == format(float(value[1, 4, 2]), ".3g") and at(data[1], 2, 4) == "-"  # above: blank
    one_sign = out.plot(f"{DELTA}.decays")  # log decays, all below zero: a sequential map that ends at zero
    assert one_sign.data["limits"][1] == 0.0 and not one_sign.matplotlib.axes[0].images[0].cmap.name.startswith("RdBu")


def test_the_lens_cells_carry_each_blocks_top_tokens_and_probabilities(ig_plots, run, tokenizer):
    ids, _ = run
    lens = ig_plots.logit_lens(ids, top=3)
    (grid,) = grids(lens.plot(batch=1)._repr_html_())
    assert grid["rows"] == [f"block {b}" for b in range(4)] and not grid["top"]  # block 0 at the bottom
    assert grid["columns"][4] == f"position 4: {tokenizer.decode([int(ids[1, 4])])}"
    for block, position in [(0, 0), (3, 10), (2, 5)]:
        probabilities = lens.top_probs[1, block, position]
        assert at(grid, block, position) == format(float(probabilities[0]), ".3g")
        words = [repr(tokenizer.decode([int(i)]))[1:-1].replace(" ", "␣") for i in lens.top_ids[1, block, position]]
        note = grid["notes"][block * 11 + position]
        assert note == "top 3: " + " · ".join(f"{w} {float(p):.3g}" for w, p in zip(words, probabilities))


def test_a_patching_sweep_plots_each_values_metric_at_each_location(ig_plots, run):
    ids, _ = run
    result = qgraph.patch(ig_plots, ids[:1], ids[1:], ["layers.1.layer_output", "layers.3.layer_output"], metric,
                          positions=[0, 4, -1])
    assert isinstance(result, dict) and set(result) == {"layers.1.layer_output", "layers.3.layer_output"}
    fig = result.plot()
    (grid,) = grids(fig._repr_html_())
    assert grid["rows"] == list(result) and grid["columns"] == ["0: t", "4: c", "10: t"]  # the clean prompt's tokens
    for row, name in enumerate(result):
        for column in range(3):
            assert at(grid, row, column) == format(float(result[name][column]), ".3g")
    low, high = fig.data["limits"]
    assert low == -high and high == max(float(v.abs().max()) for v in result.values())
    both = qgraph.patch(ig_plots, ids[:1], ids[1:], f"{ATTN}.attention_probabilities", metric, positions=[3, 10],
                        heads="each")
    (panel,) = grids(both.plot(tokens=list("abcdefghijk"))._repr_html_())  # heads (down) × positions (across)
    assert panel["rows"] == [f"head {h}" for h in range(4)] and panel["columns"] == ["3: d", "10: k"]
    assert at(panel, 2, 1) == format(float(both[f"{ATTN}.attention_probabilities"][1, 2]), ".3g")


# -- in Chromium ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # starts a Chromium process
def test_hovering_a_cell_in_chromium_shows_the_value_qgraph_computed(ig_plots, run, browser, tmp_path):
    """The pointer goes to a cell by the picture itself (the image matplotlib drew for that head), not by the
    hover layer: the tooltip must name that cell and hold the tensor's value there."""
    from selenium.webdriver.common.by import By
    ids, out = run
    pattern = out[f"{ATTN}.attention_probabilities"][1].detach()
    fig = out.plot(f"{ATTN}.attention_probabilities", batch=1)
    browser.get(fig.save(tmp_path / "pattern.html").as_uri())
    images = browser.find_elements(By.CSS_SELECTOR, "svg image")
    assert len(images) == 4 + 1  # a picture per head, and the colour bar's
    tip = browser.find_element(By.CSS_SELECTOR, ".qg-tip")
    tokens = ["␣" if c == " " else c for c in PROMPTS[1]]
    for head, query, key in [(0, 3, 1), (2, 9, 4), (3, 10, 10)]:
        hover(browser, images[head], (key + 0.5) / 11, (query + 0.5) / 11)
        value = format(float(pattern[head, query, key]), ".3g")
        assert tip.is_displayed()
        assert tip.text.split("\n") == [f"head {head}", f"query {query}: {tokens[query]}", f"key {key}: {tokens[key]}",
                                        f"attention_probabilities: {value}"]
        assert tip.get_attribute("data-value") == value and float(value) == pytest.approx(
            float(pattern[head, query, key]), rel=5e-3)
    hover(browser, images[1], 3.5 / 11, 7.5 / 11)  # a cell whose tooltip stays inside the figure, for the picture
    assert tip.text.startswith("head 1\nquery 7: r\nkey 3: d")
    screenshots = ROOT / "docs" / "gallery" if os.environ.get("QGRAPH_SCREENSHOTS") == "1" else tmp_path
    browser.find_element(By.CSS_SELECTOR, ".qgraph-figure").screenshot(str(screenshots / "pattern-hover.png"))
    lens = ig_plots.logit_lens(ids)
    browser.get(lens.plot(batch=1).save(tmp_path / "lens.html").as_uri())
    image = browser.find_element(By.CSS_SELECTOR, "svg image")
    hover(browser, image, 6.5 / 11, 1 - 2.5 / 4)  # block 2 (from the bottom), position 6
    tip = browser.find_element(By.CSS_SELECTOR, ".qg-tip")
    assert tip.text.split("\n")[:3] == ["block 2", f"position 6: {tokens[6]}",
                                        f"top-1 probability: {float(lens.top_probs[1, 2, 6, 0]):.3g}"]
    assert console_errors(browser) == []
