"""The pictures of Qwen3.8-Flash-Next (``qwen4_exp``, issue 58 item 5) on the tiny checkpoint, checked on the numbers
they show: how much each stream carries (the norms in a figure's hover equal the norms of the captured streams,
a left-padded row's pads left out), the injection weights, QSA's kept keys (the mask drawn and the outline
around them equal the captured selection) beside the full attention (equal to the HF forward's with the
selection turned off), and the block diagram's streams drawn as one bundle."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import qgraph
from qgraph.errors import InvalidArgument, NotCaptured, NotSupported
from qgraph.render import diagram
from tests.pages import browser, console_errors, hover, hover_grids  # noqa: F401 - browser is a fixture

PROMPTS = ["the cat sat on the mat and purred", "a dog ran home"]  # 33 and 14 byte tokens: row 1 left-padded
QSA = "layers.3.self_attn"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def qwen4(qwen4_models):
    return qwen4_models("sdpa")  # conftest's: its export shared with the other qwen4 test files


@pytest.fixture(scope="module")
def batch(qwen4_checkpoint):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(qwen4_checkpoint)
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    assert encoded.input_ids.shape == (2, 33) and encoded.attention_mask[1].sum() == 14
    return encoded.input_ids, encoded.attention_mask


@pytest.fixture(scope="module")
def out(qwen4, batch):
    ig = qgraph.instrument(qwen4, values=["layers.*.layer_output", "layers.*.*_mix.injection_weights",
                                          "layers.*.*_mix.mix_weights", f"{QSA}.selected_tokens",
                                          f"{QSA}.attention_queries", f"{QSA}.attention_keys"])
    ids, mask = batch
    return ig(ids, attention_mask=mask)


def shown(values: torch.Tensor) -> list[str]:
    """A grid's values as its hover writes them (3 significant digits; "-" blank)."""
    return ["-" if v != v else format(v, ".3g") for v in values.flatten().tolist()]


def real(batch, row: int) -> torch.Tensor:
    return torch.nonzero(batch[1][row]).flatten()


# -- how much each stream carries, and the injection weights -------------------------------------------------


@pytest.mark.parametrize("row", [0, 1])
def test_the_streams_grid_is_each_streams_norm_averaged_over_the_rows_tokens(out, batch, row):
    fig = out.plot("layers.*.layer_output", batch=row)
    tokens = real(batch, row)
    norms = torch.stack([out[f"layers.{b}.layer_output"][row].detach().norm(dim=-1) for b in range(4)])
    expected = norms[:, tokens].mean(dim=1)  # [blocks, streams]: the pads (row 1's first 19) left out
    grid, = hover_grids(fig.to_html())
    assert grid["rows"] == [f"layers.{b}.layer_output" for b in range(4)]
    assert grid["columns"] == ["stream 0", "stream 1", "stream 2"] and grid["what"] == "norm"
    assert grid["cells"] == shown(expected)
    torch.testing.assert_close(fig.data["grid"], expected)
    assert fig.data["grid"][2:].min() > 5 * fig.data["grid"][:2].max()  # the PLE layer before block 2 adds much
    least = norms[3, tokens, 1].argmin()
    assert grid["notes"][3 * 3 + 1].startswith(f"least {float(norms[3, tokens[least], 1]):.3g} at token "
                                                f"{int(tokens[least])}: ")
    at_last = out.plot("layers.*.layer_output", batch=row, position=-1)
    assert hover_grids(at_last.to_html())[0]["cells"] == shown(norms[:, -1])
    assert "token 32: " in at_last.matplotlib.axes[0].get_title()


def test_the_injection_weights_of_every_mix_per_stream(out, batch):
    fig = out.plot("layers.*.*_mix.injection_weights", batch=1)
    names = [f"layers.{b}.{mix}.injection_weights" for b in range(4) for mix in ("attention_mix", "mlp_mix")]
    tokens = real(batch, 1)
    grid, = hover_grids(fig.to_html())
    assert grid["rows"] == names and grid["what"] == "injection weight"
    expected = torch.stack([out[n][1, tokens].detach().mean(dim=0) for n in names])
    assert grid["cells"] == shown(expected)
    assert fig.data["rows"] == [n.removesuffix(".injection_weights") for n in names]
    one = out.plot("layers.*.*_mix.injection_weights", position=5)
    assert hover_grids(one.to_html())[0]["cells"] == shown(torch.stack([out[n][0, 5].detach() for n in names]))


def test_one_value_is_its_streams_by_its_tokens(out, batch):
    tokens = real(batch, 1)
    fig = out.plot("layers.1.attention_mix.injection_weights", batch=1)
    grid, = hover_grids(fig.to_html())
    assert grid["cells"] == shown(out["layers.1.attention_mix.injection_weights"][1, tokens].detach().T)
    assert grid["rows"] == ["stream 0", "stream 1", "stream 2"]
    assert grid["columns"][0] == "token 19: a" and len(grid["columns"]) == 14  # the pads are not drawn
    norms = out.plot("layers.2.layer_output")
    assert hover_grids(norms.to_html())[0]["cells"] == shown(out["layers.2.layer_output"][0].detach().norm(dim=-1).T)
    weights = out.plot("layers.0.mlp_mix.mix_weights")  # a weight per channel: its mean
    assert weights.data["what"] == "mean mix weight"
    torch.testing.assert_close(weights.data["grid"], out["layers.0.mlp_mix.mix_weights"][0].detach().mean(dim=-1).T)


def test_stream_plot_mistakes_are_named(out, batch):
    with pytest.raises(InvalidArgument, match="position=3 picks the token of a glob's grid.*'layers.\\*.layer_output'"):
        out.plot("layers.1.layer_output", position=3)
    with pytest.raises(InvalidArgument, match="position 2 of row 1 is padding: pick one of its tokens \\(19 to 32\\)"):
        out.plot("layers.*.layer_output", batch=1, position=2)
    with pytest.raises(NotSupported, match="one kind of hyper-connection streams"):
        out.plot("layers.0.*_mix.*")  # injection weights and mix weights: a weight and a norm do not share a grid


# -- QSA's kept keys beside the full attention ----------------------------------------------------------------


def filled(segments, rows: int, columns: int) -> torch.Tensor:
    """The cells an outline encloses, read back from its segments: scanning each row (column), a cell is inside
    between a border crossed an odd and an even number of times."""
    inside = torch.zeros(rows, columns, dtype=torch.bool)
    across = torch.zeros(rows, columns, dtype=torch.bool)
    for r in range(rows):
        xs = sorted(float(a[0]) for a, b in segments if a[0] == b[0] and min(a[1], b[1]) == r - 0.5)
        for start, stop in zip(xs[::2], xs[1::2]):
            inside[r, round(start + 0.5):round(stop + 0.5)] = True
    for c in range(columns):
        ys = sorted(float(a[1]) for a, b in segments if a[1] == b[1] and min(a[0], b[0]) == c - 0.5)
        for start, stop in zip(ys[::2], ys[1::2]):
            across[round(start + 0.5):round(stop + 0.5), c] = True
    assert torch.equal(inside, across)
    return inside


def hf_full_attention(checkpoint, batch) -> torch.Tensor:
    """Block 3's attention weights in the HF eager forward with its indexer keeping every key (the selection off)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    attention = model.model.layers[3].self_attn
    seen = {}
    attention.indexer.forward = lambda hidden, position, mask, *args, **kwargs: torch.ones_like(mask, dtype=torch.bool)
    attention.register_forward_hook(lambda module, args, output: seen.update(weights=output[1]))
    with torch.no_grad():
        model(batch[0], attention_mask=batch[1])
    return seen["weights"]


@pytest.mark.parametrize("row", [0, 1])
def test_the_kept_keys_drawn_and_outlined_are_the_selection(out, batch, row):
    fig = out.plot(f"{QSA}.selected_tokens", batch=row)
    tokens = real(batch, row)
    selected = out[f"{QSA}.selected_tokens"][row][tokens][:, tokens]
    assert torch.equal(fig.data["kept"], selected) and torch.equal(fig.data["keys"], tokens)
    assert selected.sum(dim=1).lt(torch.arange(1, len(tokens) + 1)).any()  # past 11 tokens it drops keys
    visible = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
    grids = hover_grids(fig.to_html())
    assert len(grids) == 1 + 4 and grids[0]["what"] == "kept"
    assert grids[0]["cells"] == ["1" if k else "0" if v else "-" for k, v in zip(selected.flatten().tolist(),
                                                                               visible.flatten().tolist())]
    assert grids[0]["rows"][0] == f"query {int(tokens[0])}: {'t' if row == 0 else 'a'}"
    outlines = [c for axes in fig.matplotlib.axes for c in axes.collections if c.get_label() == "kept keys"]
    assert len(outlines) == 4  # one per head
    for outline in outlines:
        assert torch.equal(filled(outline.get_segments(), *selected.shape), selected)


def test_the_full_attention_is_the_blocks_attention_with_the_selection_off(out, batch, qwen4_checkpoint):
    reference = hf_full_attention(qwen4_checkpoint, batch)  # [batch, heads, query, key]
    for row in (0, 1):
        fig = out.plot(f"{QSA}.selected_tokens", batch=row)
        tokens = real(batch, row)
        expected = reference[row][:, tokens][:, :, tokens]
        visible = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
        pattern = fig.data["pattern"]
        assert torch.isnan(pattern[:, ~visible]).all()
        torch.testing.assert_close(pattern[:, visible], expected[:, visible], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(fig.data["kept_share"], (expected * fig.data["kept"]).sum(dim=-1), rtol=1e-4,
                                   atol=1e-6)
        grids = hover_grids(fig.to_html())
        assert [g["panel"] for g in grids[1:]] == ["head 0", "head 1", "head 2", "head 3"]
        assert all(g["cells"] == shown(pattern[h]) for h, g in enumerate(grids[1:]))
    two = out.plot(f"{QSA}.selected_tokens", heads=[2])
    assert two.data["heads"] == [2] and "head 2" in two.matplotlib.axes[1].get_title()
    torch.testing.assert_close(two.data["pattern"][0], out.plot(f"{QSA}.selected_tokens").data["pattern"][2],
                               equal_nan=True)


def test_the_selection_without_its_queries_and_keys_says_what_to_capture(qwen4, batch):
    bare = qgraph.instrument(qwen4, values=[f"{QSA}.selected_tokens"])(batch[0])
    with pytest.raises(NotCaptured, match="lacks layers.3.self_attn.attention_queries, layers.3.self_attn."
                                          "attention_keys: capture them with it"):
        bare.plot(f"{QSA}.selected_tokens")


# -- the block diagram: the streams as a bundle --------------------------------------------------------------


def test_the_streams_are_drawn_as_one_bundle(qwen4, sdpa_model):
    from qgraph.render.dot import to_graphviz
    block = diagram(qwen4, "block", 1)
    taps = {name: box.id for name, box in block.taps().items()}

    def touching(*names):
        return [w for w in block.wires if {taps[f"layers.1.{n}"] for n in names} & {w.src, w.dst}]
    assert {w.streams for w in touching("layer_input", "layer_mid", "layer_output", "attention_mix.normed_streams",
                                         "mlp_mix.mix_weights")} == {3}
    assert {w.streams for w in touching("attention_mix.mixed_input", "self_attn.attention_output", "mlp.mlp_output",
                                         "attention_mix.injection_weights")} == {1}
    entering = next(w for w in block.wires if w.dst == taps["layers.1.layer_input"])
    assert block.boxes[entering.src].kind == "stream" and entering.label == "3 streams"
    labelled = [w for w in block.wires if w.label]  # where a bundle starts: the streams entering, each mix's
    assert {w.label for w in labelled} == {"3 streams"} and len(labelled) == 5  # weights, each output written in
    assert all(w.streams == 3 for w in labelled)
    assert '"#2B2B2B:#FFFFFF:#2B2B2B:#FFFFFF:#2B2B2B"' in to_graphviz(block).source
    model = diagram(qwen4, "model")
    blocks = {box.id: named[1] for box in model.boxes.values()
              if (named := re.match(r"<B>(layers\.\d|final_mix)</B>", box.label))}
    joined = {(blocks.get(w.src), blocks.get(w.dst)) for w in model.wires if w.streams == 3}
    assert {("layers.0", "layers.1"), ("layers.1", "layers.2"), ("layers.2", "layers.3"),
            ("layers.3", "final_mix")} <= joined
    assert all(w.streams == 1 for w in model.wires if w.src == next(i for i, k in blocks.items() if k == "final_mix"))
    plain = diagram(sdpa_model, "block", 3)  # Qwen3.5: one residual stream, a plain line
    assert all(w.streams == 1 and not w.label for w in plain.wires)


# -- in Chromium: the pictures of docs/qwen4.md --------------------------------------------------------------


@pytest.mark.slow  # starts a Chromium process
def test_hovering_each_picture_shows_its_number(out, browser, tmp_path):
    """Each picture in Chromium: a hover over a cell of the image matplotlib drew names that cell and holds the
    number computed from the output. With QGRAPH_SCREENSHOTS=1 the screenshots are docs/gallery's."""
    from selenium.webdriver.common.by import By
    where = ROOT / "docs" / "gallery" if os.environ.get("QGRAPH_SCREENSHOTS") == "1" else tmp_path
    norms = torch.stack([out[f"layers.{b}.layer_output"][0].detach().norm(dim=-1).mean(dim=0) for b in range(4)])
    injection = out["layers.3.attention_mix.injection_weights"][0].detach()
    selection = out.plot(f"{QSA}.selected_tokens", heads=[0, 1])
    text = selection.data["tokens"]  # the prompt's tokens: "t", "h", "e", "␣", ...
    pictures = [  # (figure, file, image, cell (row, column) of rows x columns, the tooltip's lines)
        (out.plot("layers.*.layer_output"), "qwen4-streams.png", 0, (1, 0), (4, 3), [  # block 0 is at the bottom
            "layers.2.layer_output", "stream 0", f"norm: {float(norms[2, 0]):.3g}"]),
        (out.plot("layers.3.attention_mix.injection_weights"), "qwen4-injection.png", 0, (1, 12), (3, 33), [
            "stream 1", f"token 12: {text[12]}", f"injection weight: {float(injection[12, 1]):.3g}"]),
        (selection, "qwen4-selection.png", 1, (20, 9), (33, 33), [
            "head 0", f"query 20: {text[20]}", f"key 9: {text[9]}",
            f"full attention: {float(selection.data['pattern'][0, 20, 9]):.3g}"]),
    ]
    for fig, name, image, (r, c), (rows, columns), lines in pictures:
        browser.get(fig.save(tmp_path / name.replace(".png", ".html")).as_uri())
        images = browser.find_elements(By.CSS_SELECTOR, "svg image")
        hover(browser, images[image], (c + 0.5) / columns, (r + 0.5) / rows)
        tip = browser.find_element(By.CSS_SELECTOR, ".qg-tip")
        assert tip.is_displayed() and tip.text.split("\n")[:len(lines)] == lines, name
        browser.find_element(By.CSS_SELECTOR, ".qgraph-figure").screenshot(str(where / name))
    assert console_errors(browser) == []
