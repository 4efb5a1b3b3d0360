"""``qgraph.explore`` (issue 28): one offline page with every block kind's annotated diagram, where each
value is an element carrying ``data-value``; the page carries what a click shows in ``#detail`` (layout,
availability, and for the values ``out`` holds their statistics and plot). A real browser clicks it in
the notebook test; here the page's parts and data are checked, and its script's syntax."""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import pytest

from tests.pages import hover_grids
import torch

import qgraph
from qgraph.errors import InvalidArgument, InvalidType, OutOfRange
from qgraph.render.engine import Digraph, available

pytestmark = pytest.mark.skipif(available() is None, reason="the diagrams need Graphviz (dot or pygraphviz)")

HELD = ["layers.0.linear_attn.decays", "layers.3.layer_output"]


@pytest.fixture(scope="module")
def explored(sdpa_model):
    ig = qgraph.instrument(sdpa_model, values=HELD)
    out = ig(torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2)))
    fig = qgraph.explore(ig, out)
    return ig, out, fig, fig._repr_html_()


def data_of(page: str) -> dict:
    payload = re.search(r'<script type="application/json" class="qg-data">(.*?)</script>', page, re.S).group(1)
    return json.loads(payload)


def value_elements(page: str) -> dict[str, list[str]]:
    """``{name: [tag of each element carrying data-value=name]}``."""
    found: dict[str, list[str]] = {}
    for tag, name in re.findall(r'<(\w+)\s[^>]*?data-value="([^"]+)"', page):
        found.setdefault(html.unescape(name), []).append(tag)
    return found


def test_every_value_of_blocks_0_and_3_is_a_box_of_its_diagram(explored):
    ig, _, fig, page = explored
    assert isinstance(fig, qgraph.Figure) and fig.formats == ("html",)
    elements = value_elements(page)
    for block in (0, 3):
        names = [n for n, e in ig.catalogue.items() if e.spec is not None and n.startswith(f"layers.{block}.")]
        assert len(names) > 10
        for name in names:  # a box (a node's <g>, or a strip over a box naming several) of the block's diagram
            assert set(elements.get(name, ())) & {"g", "rect"}, name
    # the other blocks of a kind are lists of their values, collapsed
    assert "layers.1.linear_attn.decays" in elements and "layers.2.mlp.mlp_output" in elements
    assert re.search(r'<details class="qg-block"><summary>block 1 ', page)
    assert '<details open class="qg-kind"><summary>gated DeltaNet blocks (linear_attention): 0, 1, 2</summary>' in page
    assert '<details open class="qg-kind"><summary>gated attention blocks (full_attention): 3</summary>' in page
    assert page.count('id="detail"') == 1


def test_the_page_is_offline(explored):
    page = explored[3]
    assert not re.findall(r"https?://", page)
    assert not re.search(r"<script[^>]*\ssrc=|<link\b|@import|url\((?!#)|<iframe", page)
    assert page.count("<svg") >= 3  # the model and the two kinds of block


def test_a_click_shows_layout_availability_and_the_stats_and_plot_of_what_out_holds(explored):
    ig, out, _, page = explored
    data = data_of(page)
    decays = out["layers.0.linear_attn.decays"].detach()
    facts = data["layers.0.linear_attn.decays"]
    assert facts["layout"] == "Gates [batch seq value_heads]" and facts["availability"] == "yes"
    assert facts["shape"] == "[1 9 4]" and facts["dtype"] == "float32"
    assert facts["stats"] == {k: f"{v:.6g}" for k, v in [("mean", decays.mean().item()), ("std", decays.std().item()),
                                                         ("min", decays.min().item()), ("max", decays.max().item())]}
    assert "<svg" in facts["plot"] and "head 3" in facts["plot"]
    (grid,) = hover_grids(facts["plot"])  # the plot answers a hover: each cell the value qgraph computed
    cells = [float(cell) for cell in grid["cells"]]
    assert cells == [float(format(float(v), ".3g")) for v in decays[0].T.flatten()]  # heads (down) x tokens
    assert data["layers.3.layer_output"]["stats"]["max"] == f"{out['layers.3.layer_output'].max().item():.6g}"
    states = data["layers.0.linear_attn.states"]  # not captured: what it is and how to get it, no numbers
    assert "made on request" in states["availability"] and "shape" not in states
    assert "captured by this instrument" == facts["role"]
    assert data["__out__"] is True


def test_the_click_handler_is_plain_script():
    from qgraph.explore import _SCRIPT
    assert 'getAttribute("data-value")' in _SCRIPT and "[id=detail]" in _SCRIPT
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node to check the script's syntax")
    checked = subprocess.run([node, "--check", "-"], input=_SCRIPT % {"key": "qg-x"}, capture_output=True, text=True,
                             timeout=60)
    assert checked.returncode == 0, checked.stderr


def test_a_model_without_out_and_chosen_blocks(sdpa_model):
    page = qgraph.explore(sdpa_model, blocks=[3])._repr_html_()
    data = data_of(page)
    assert data["__out__"] is False and "shape" not in data["layers.3.layer_output"]
    elements = value_elements(page)
    assert "g" in elements["layers.3.self_attn.attention_probabilities"]  # drawn
    assert elements["layers.0.linear_attn.decays"] == ["span"]  # listed only
    with pytest.raises(OutOfRange, match="block 9"):
        qgraph.explore(sdpa_model, blocks=[9])
    with pytest.raises(InvalidArgument, match="plots="):
        qgraph.explore(sdpa_model, plots=-1)
    with pytest.raises(InvalidType):
        qgraph.explore("a model")


def test_a_box_naming_several_values_gets_one_strip_each():
    from qgraph.explore import tag_values
    g = Digraph()
    g.node("t0", "<a<BR/>b>", id="layers.0.a+layers.0.b", shape="box", style="rounded")  # as a tap box is drawn
    g.node("t1", "c", id="layers.0.c")
    svg, names = tag_values(g.pipe(format="svg", encoding="utf-8"), {"layers.0.a", "layers.0.b", "layers.0.c"})
    assert names == ["layers.0.a", "layers.0.b", "layers.0.c"]
    strips = re.findall(r'<rect [^>]*y="(-?[\d.]+)" [^>]*height="([\d.]+)"[^>]*data-value="([^"]+)"', svg)
    assert [name for _, _, name in strips] == ["layers.0.a", "layers.0.b"]
    (y0, h0, _), (y1, h1, _) = strips
    assert float(h0) > 0 and float(h0) == pytest.approx(float(h1)) and float(y0) + float(h0) == pytest.approx(float(y1))
    assert re.search(r'<g id="layers.0.c" class="node qg-value" data-value="layers.0.c"', svg)


def test_every_value_of_a_call_with_every_value_and_a_plain_one_shown_as_it_is(ig, out, ids):
    """``instrument(model, values=["**"])`` captures ``input_size``, a ``torch.Size``: the page shows it as it
    is (no statistics), and every tensor value its shape and statistics, as plain torch computes them."""
    data = data_of(qgraph.explore(ig, out, plots=0)._repr_html_())
    assert isinstance(out["input_size"], torch.Size)
    assert data["input_size"]["value"] == str(tuple(ids.shape)) == "(2, 70)"
    assert data["input_size"]["dtype"] == "Size" and "shape" not in data["input_size"]
    assert "stats" not in data["input_size"]
    for name, value in out.values.items():
        if isinstance(value, torch.Tensor):
            assert data[name]["shape"] == "[" + " ".join(map(str, value.shape)) + "]", name
            if value.is_floating_point() and torch.isfinite(value).all():
                assert data[name]["stats"]["max"] == f"{value.detach().float().max().item():.6g}", name
    residual = out["layers.3.layer_output"].detach()
    assert data["layers.3.layer_output"]["stats"]["mean"] == f"{residual.mean().item():.6g}"
