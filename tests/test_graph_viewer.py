"""The attribution-graph viewer (qgraph/circuits/viewer.py, viewer.js) and the paper figure (render.py); reading
circuit-tracer's files is tests/test_graph_file.py.

The page's SVG holds every kept node and edge with the graph's numbers; strings from a graph or a file are
escaped; PNG, SVG and HTML save; the graphviz figure is bounded in width.
The slow tests open the page in headless Chromium: hovering a node lists its strongest edges with the
graph's weights, a click pins exactly its neighbours, the slider hides the edges under its threshold, a
supernode groups its members and sums their edges, and hostile strings stay text.
"""
from __future__ import annotations

import io
import os
import re
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from qgraph import AttributionGraph, QgraphError
from qgraph.circuits.layout import NEGATIVE, POSITIVE, visible
from qgraph.figure import Figure
from qgraph.render.engine import available
from test_circuit_graph import chain_graph, circuit_tracer_file, random_graph
from tests.pages import browser, console_errors  # noqa: F401 (browser: a fixture)

ROOT = Path(__file__).resolve().parent.parent
SVG = "{http://www.w3.org/2000/svg}"
HOSTILE = ["</script><script>document.title='pwned-token'</script>", "<img src=x onerror=\"document.title='pwned'\">"]


def nodes_and_edges(fig: Figure) -> tuple[list[dict], list[tuple[str, str, float]]]:
    """The nodes (their data attributes) and edges (source id, target id, weight) the figure's SVG holds."""
    root = ET.fromstring(fig.svg)
    nodes = [dict(g.attrib) for g in root.iter(f"{SVG}g") if "qg-node" in g.get("class", "").split()]
    edges = [(p.get("data-source"), p.get("data-target"), float(p.get("data-weight")))
             for p in root.iter(f"{SVG}path") if "qg-edge" in p.get("class", "").split()]
    return nodes, edges


def graph_edges(graph: AttributionGraph) -> set[tuple[str, str, float]]:
    ids = [node.node_id for node in graph.nodes]
    targets, sources = graph.edge_mask.nonzero(as_tuple=True)
    return {(ids[s], ids[t], graph.adjacency[t, s].item()) for t, s in zip(targets.tolist(), sources.tolist())}


# -- the page --------------------------------------------------------------------------------------------
def test_the_page_carries_every_kept_node_and_edge_with_the_graphs_numbers():
    graph = random_graph(1)
    pruned = graph.prune(0.9, 0.95)
    fig = graph.plot(node_threshold=0.9, edge_threshold=0.95)
    nodes, edges = nodes_and_edges(fig)
    assert [n["data-id"] for n in nodes] == [n.node_id for n in pruned.nodes]
    assert set(edges) == graph_edges(pruned) and len(edges) == int(pruned.edge_mask.sum()) > 10
    for drawn, node in zip(nodes, pruned.nodes):
        assert drawn["data-kind"] == node.kind and int(drawn["data-pos"]) == node.position
        assert drawn.get("data-layer") == (None if node.layer is None else str(node.layer))
        assert drawn.get("data-feature") == (None if node.feature is None else str(node.feature))
        if node.kind == "feature":
            assert float(drawn["data-activation"]) == node.activation
            assert float(drawn["data-influence"]) == node.influence
    logits = [n for n in nodes if n["data-kind"] == "logit"]
    assert [float(n["data-probability"]) for n in logits] == pruned.logit_probabilities.tolist()
    page = fig._repr_html_()
    for node, drawn in zip(pruned.nodes, nodes):  # logits labelled with their token and probability
        if node.kind == "logit":
            assert f"{drawn['data-label'].split(' p=')[0]} {float(drawn['data-probability']):.2f}</text>" in page
    colours = re.findall(r'data-weight="([^"]+)"[^>]*stroke="([^"]+)"', page)
    assert colours and all(colour == (POSITIVE if float(w) >= 0 else NEGATIVE) for w, colour in colours)


def test_the_page_is_one_offline_file_with_title_legend_and_tokens_as_text(tmp_path):
    graph = chain_graph()
    graph.tokens = ["The", " cat"]
    fig = graph.plot(labels={(1, 3): "sitting"}, top_logits={(1, 3): [" sat", " sits"]})
    page = fig.to_html()
    assert not re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:|//)", page)
    assert not re.search(r"<script[^>]*\ssrc=|<link\b|@import|url\((?!#)|<iframe|<img", page)
    assert "http" not in page  # not even a namespace: the page's SVG is inline
    assert page.count("<script>") == 1 and "Attribution graph · “The cat”" in page
    assert "feature, filled by influence on the logits" in page and "negative edge" in page  # the legend
    tokens = [t for t in ET.fromstring(fig.svg).iter(f"{SVG}text") if t.get("class") == "qg-token"]
    assert [t.text for t in tokens] == ["The", "␣cat"]  # along the bottom, the space visible
    assert "activation 1.5" in page and "label: sitting" in page and "top logits: ␣sat, ␣sits" in page
    assert fig.formats == ("html", "svg", "png")


def test_hostile_strings_are_escaped(tmp_path):
    graph = chain_graph()
    graph.tokens, graph.logit_tokens = list(HOSTILE), [HOSTILE[1], HOSTILE[0]]
    graph.prompt = HOSTILE[0]
    page = graph.plot(labels={(1, 3): HOSTILE[1]}).to_html()
    assert page.count("<script") == 1 and "<img" not in page and "</script><script>" not in page
    assert "&lt;img src=x onerror=" in page
    # the same through a file: a clerp, a token and the prompt of circuit-tracer's JSON
    path = graph.to_json(tmp_path / "hostile.json", labels={(1, 3): HOSTILE[0]}, node_threshold=0.995)
    loaded = AttributionGraph.from_json(path)
    assert loaded.labels == {(1, 3): HOSTILE[0]} and loaded.tokens == HOSTILE
    page = loaded.plot().to_html()
    assert page.count("<script") == 1 and "<img" not in page and "&lt;/script&gt;&lt;script&gt;" in page
    ET.fromstring(loaded.plot().svg)  # the standalone SVG stays well-formed


def test_png_svg_and_html_save(tmp_path):
    from PIL import Image

    fig = random_graph(2).plot()
    png = fig.save(tmp_path / "graph.png")
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 1000 and image.size[1] > 400
        colours = {colour for _, colour in image.convert("RGB").getcolors(1 << 20)}
    assert (33, 102, 172) in colours and (178, 24, 43) in colours  # the strongest edges, opaque enough
    svg = ET.parse(fig.save(tmp_path / "graph.svg")).getroot()
    assert svg.tag == f"{SVG}svg" and len([g for g in svg.iter(f"{SVG}g") if "qg-node" in g.get("class", "")]) > 10
    assert fig.save(tmp_path / "graph.html").read_text().startswith("<!DOCTYPE html>")


def test_show_opens_the_page_in_a_browser_outside_a_notebook(monkeypatch, capsys):
    opened = []
    monkeypatch.setattr("webbrowser.open", opened.append)
    fig = chain_graph().show()
    assert isinstance(fig, Figure) and len(opened) == 1 and opened[0].startswith("file://")
    path = opened[0][len("file://"):]
    assert path in capsys.readouterr().out and 'class="qg-viewer"' in open(path, encoding="utf-8").read()


def test_show_displays_the_page_in_a_notebooks_cell(monkeypatch):
    IPython = pytest.importorskip("IPython")
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython, "get_ipython", lambda: SimpleNamespace(kernel=object()))  # as in a kernel
    monkeypatch.setattr(IPython.display, "display", shown.append)
    monkeypatch.setattr("webbrowser.open", lambda uri: pytest.fail(f"a browser opened {uri}"))
    fig = chain_graph().show()
    assert shown == [fig] and 'class="qg-viewer"' in fig._repr_html_()


def test_a_full_graph_is_pruned_before_it_is_drawn():
    graph = chain_graph()
    assert len(nodes_and_edges(graph.plot())[0]) == len(graph.prune().nodes)
    with pytest.raises(QgraphError, match="pruned already"):
        graph.prune(0.5, 0.5).plot(node_threshold=0.8)


# -- the paper figure ------------------------------------------------------------------------------------
def test_graphviz_places_tokens_as_text_layers_in_bands_and_stays_narrow():
    pytest.importorskip("graphviz")
    graph = random_graph(3, n_layers=4, seq=12, n_logits=8)
    graph.tokens = [f" w{p}" for p in range(12)]
    pruned = graph.prune(0.95, 0.99)
    dot = pruned.to_graphviz(width=8)
    source = dot.source
    found = {int(i): body for i, body in re.findall(r"^\s*n(\d+) \[(.*?)\]$", source, re.M | re.S)}
    assert sorted(found) == list(range(len(pruned.nodes)))
    ys: dict[int, list[float]] = {}
    for i, node in enumerate(pruned.nodes):
        label = re.search(r'label="((?:[^"\\]|\\.)*)"', found[i])[1]
        x, y = map(float, re.search(r'pos="([-\d.]+),([-\d.]+)!"', found[i]).groups())
        assert 0 <= x <= 8 * 66 / 72 + 0.01  # inches: within the width of 8 nodes
        ys.setdefault(0 if node.kind == "embedding" else node.layer + 1, []).append(y)
        if node.kind == "embedding":
            assert label == visible(graph.tokens[node.position]) == f"␣w{node.position}"  # text, not an id
        if node.kind == "logit":  # its token and probability
            j = i - (len(pruned.nodes) - pruned.count("logit"))
            assert label == f"{pruned.logit_tokens[j]}\np={pruned.logit_probabilities[j]:.2f}"
    bands = [ys[layer] for layer in sorted(ys)]
    assert all(max(lower) < min(upper) for lower, upper in zip(bands, bands[1:]))  # layers upward, apart
    edges = re.findall(r"^\s*n(\d+) -> n(\d+) \[[^\]]*color=\"([^\"]+)\"", source, re.M)
    assert len(edges) == int(pruned.edge_mask.sum())
    for s, t, colour in edges:
        assert colour.startswith(POSITIVE if pruned.adjacency[int(t), int(s)] > 0 else NEGATIVE)
    if available():
        from PIL import Image
        with Image.open(io.BytesIO(dot.pipe("png"))) as image:
            assert image.size[0] < 900, image.size  # px: bounded, however many nodes a layer has


# -- in a browser ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict:
    """Viewer pages: a graph qgraph pruned, and a file circuit-tracer's own functions wrote, read back."""
    folder = tmp_path_factory.mktemp("viewer")
    ours = random_graph(0, n_layers=3, seq=5, n_logits=3).prune(0.9, 0.98)
    theirs_file = folder / "theirs.json"
    theirs_file.write_text(circuit_tracer_file(random_graph(1), 0.8, 0.98).model_dump_json(), encoding="utf-8")
    theirs = AttributionGraph.from_json(theirs_file)
    return {name: (graph, graph.plot().save(folder / f"{name}.html")) for name, graph in
            (("qgraph", ours), ("circuit-tracer", theirs))}


SHOWN = """return Array.from(document.querySelectorAll(arguments[0])).filter(function (e) {
  return getComputedStyle(e).display !== "none"; }).map(function (e) {
  return [e.getAttribute("data-id"), e.getAttribute("data-source"), e.getAttribute("data-target"),
          e.getAttribute("data-weight")]; });"""


def shown_nodes(driver) -> set[str]:
    return {row[0] for row in driver.execute_script(SHOWN, ".qg-node")}


def shown_edges(driver) -> set[tuple[str, str, float]]:
    return {(s, t, float(w)) for _, s, t, w in driver.execute_script(SHOWN, ".qg-edge")}


def glyph(driver, node_id: str):
    from selenium.webdriver.common.by import By
    return driver.find_element(By.CSS_SELECTOR, f'g.qg-node[data-id="{node_id}"] .qg-glyph')


def opened(driver, pages: dict, which: str) -> tuple[AttributionGraph, list[str], int]:
    """Open a page: its graph, its node ids, and the feature with the most edges."""
    graph, page = pages[which]
    driver.get(page.as_uri())
    mask = graph.edge_mask
    busiest = max((i for i, n in enumerate(graph.nodes) if n.kind == "feature"),
                  key=lambda i: int(mask[i].sum() + mask[:, i].sum()))
    return graph, [n.node_id for n in graph.nodes], busiest


@pytest.mark.slow
@pytest.mark.parametrize("which", ["qgraph", "circuit-tracer"])
def test_hover_shows_a_nodes_activation_and_strongest_edges_with_the_graphs_weights(browser, pages, which):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    graph, ids, i = opened(browser, pages, which)
    ActionChains(browser).move_to_element(glyph(browser, ids[i])).perform()
    detail = browser.find_element(By.CSS_SELECTOR, ".qg-detail")
    assert f"activation {graph.nodes[i].activation:.4g}" in detail.text
    for end, sources in (("inputs", graph.edge_mask[i]), ("outputs", graph.edge_mask[:, i])):
        others = sources.nonzero().flatten().tolist()
        weights = [(graph.adjacency[i, k] if end == "inputs" else graph.adjacency[k, i]).item() for k in others]
        expected = sorted(zip([ids[k] for k in others], weights), key=lambda e: -abs(e[1]))[:8]
        rows = detail.find_elements(By.CSS_SELECTOR, f"table.qg-{end} tr.qg-row")
        got = [(row.get_attribute("data-source" if end == "inputs" else "data-target"),
                float(row.get_attribute("data-weight"))) for row in rows]
        assert got == expected and len(got) > 0
        shown = [float(row.find_elements(By.TAG_NAME, "td")[1].text) for row in rows]
        assert shown == pytest.approx([w for _, w in expected], rel=1e-3)  # 4 significant digits
    assert console_errors(browser) == []


@pytest.mark.slow
@pytest.mark.parametrize("which", ["qgraph", "circuit-tracer"])
def test_a_click_pins_a_node_and_shows_exactly_its_neighbours(browser, pages, which):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    graph, ids, i = opened(browser, pages, which)
    everything = set(ids)
    assert shown_nodes(browser) == everything and shown_edges(browser) == graph_edges(graph)
    ActionChains(browser).click(glyph(browser, ids[i])).perform()
    neighbours = {ids[k] for k in graph.edge_mask[i].nonzero().flatten().tolist()} | \
                 {ids[k] for k in graph.edge_mask[:, i].nonzero().flatten().tolist()}
    assert shown_nodes(browser) == neighbours | {ids[i]} and len(neighbours) >= 2
    assert shown_edges(browser) == {e for e in graph_edges(graph) if ids[i] in e[:2]}
    ActionChains(browser).click(glyph(browser, ids[i])).perform()  # again: all
    assert shown_nodes(browser) == everything
    ActionChains(browser).click(glyph(browser, ids[i])).perform()
    ActionChains(browser).send_keys(Keys.ESCAPE).perform()
    assert shown_nodes(browser) == everything and shown_edges(browser) == graph_edges(graph)


@pytest.mark.slow
def test_the_slider_hides_the_edges_under_its_threshold(browser, pages):
    from selenium.webdriver.common.by import By

    graph, page = pages["circuit-tracer"]
    browser.get(page.as_uri())
    slider = browser.find_element(By.CSS_SELECTOR, ".qg-threshold")
    for value in (400, 700):
        browser.execute_script("arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input'));",
                               slider, value)
        threshold = float(slider.get_attribute("data-threshold"))
        kept = {e for e in graph_edges(graph) if abs(e[2]) >= threshold}
        assert shown_edges(browser) == kept and 0 < len(kept) < int(graph.edge_mask.sum())
        assert f"{len(kept)} of {int(graph.edge_mask.sum())} edges" in browser.find_element(By.CSS_SELECTOR,
                                                                                          ".qg-count").text


@pytest.mark.slow
def test_search_finds_nodes_by_layer_and_feature_and_enter_pins_one(browser, pages):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    graph, ids, _ = opened(browser, pages, "circuit-tracer")
    box = browser.find_element(By.CSS_SELECTOR, ".qg-search")
    feature = next(n for n in graph.nodes if n.kind == "feature" and n.layer > 0)
    inner = ("feature", "error")
    for query, wanted in ((f"L{feature.layer}", lambda n: n.kind in inner and n.layer == feature.layer),
                          (f"F{feature.feature}", lambda n: n.kind == "feature" and n.feature == feature.feature),
                          (f"L{feature.layer} F{feature.feature}", lambda n: n.kind == "feature" and
                           (n.layer, n.feature) == (feature.layer, feature.feature))):
        browser.execute_script("arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input'));",
                               box, query)
        found = {e.get_attribute("data-id") for e in browser.find_elements(By.CSS_SELECTOR, ".qg-node.qg-match")}
        assert found == {n.node_id for n in graph.nodes if wanted(n)} and feature.node_id in found, query
    box.send_keys(Keys.ENTER)
    pinned = browser.find_element(By.CSS_SELECTOR, ".qg-viewer").get_attribute("data-pinned")
    assert pinned in found and shown_nodes(browser) >= {pinned}


@pytest.mark.slow
def test_selected_features_group_into_a_supernode_whose_edges_are_their_sums(browser, pages):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    graph, page = pages["qgraph"]
    browser.get(page.as_uri())
    ids = [n.node_id for n in graph.nodes]
    members = [ids[i] for i, n in enumerate(graph.nodes) if n.kind == "feature"][:3]
    chain = ActionChains(browser).key_down(Keys.SHIFT)
    for member in members:
        chain = chain.click(glyph(browser, member))
    chain.key_up(Keys.SHIFT).perform()
    browser.find_element(By.CSS_SELECTOR, ".qg-group-name").send_keys("my circuit")
    browser.find_element(By.CSS_SELECTOR, ".qg-group").click()

    supernode = browser.find_element(By.CSS_SELECTOR, "g.qg-supernode")
    name = supernode.get_attribute("data-id")
    assert supernode.get_attribute("data-label") == "my circuit" == supernode.text
    assert set(supernode.get_attribute("data-members").split(",")) == set(members)
    assert shown_nodes(browser) == set(ids) - set(members) | {name}
    owner = {m: name for m in members}
    sums: dict[tuple[str, str], float] = {}
    for s, t, w in graph_edges(graph):
        key = (owner.get(s, s), owner.get(t, t))
        if name in key and key[0] != key[1]:
            sums[key] = sums.get(key, 0.0) + w
    drawn = {(s, t): w for s, t, w in shown_edges(browser) if name in (s, t)}
    assert drawn.keys() == sums.keys() and len(sums) > 0
    assert [drawn[k] for k in sums] == pytest.approx(list(sums.values()), rel=1e-12, abs=1e-12)
    assert not {e for e in shown_edges(browser) if e[0] in members or e[1] in members}
    ActionChains(browser).move_to_element(supernode).perform()  # its summed edges, listed
    rows = browser.find_elements(By.CSS_SELECTOR, ".qg-detail tr.qg-row")
    assert rows and all(name in (r.get_attribute("data-source"), r.get_attribute("data-target")) for r in rows)
    browser.find_element(By.CSS_SELECTOR, ".qg-supernodes button").click()  # ungroup
    assert shown_nodes(browser) == set(ids) and shown_edges(browser) == graph_edges(graph)


@pytest.mark.slow
def test_hostile_strings_stay_text_in_the_browser(browser, tmp_path):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    graph = chain_graph()
    graph.tokens, graph.prompt = list(HOSTILE), HOSTILE[0]
    path = graph.to_json(tmp_path / "hostile.json", labels={(1, 3): HOSTILE[1]}, node_threshold=0.995)
    page = AttributionGraph.from_json(path).plot().save(tmp_path / "hostile.html")
    browser.get(page.as_uri())
    time.sleep(0.3)  # an onerror would have fired by now
    assert browser.execute_script("return document.title") not in ("pwned", "pwned-token")  # the page's own
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text
    tokens = browser.find_elements(By.CSS_SELECTOR, "text.qg-token")
    shown = [browser.execute_script("return arguments[0].firstChild.nodeValue", t) for t in tokens]
    assert shown == [visible(token, 10) for token in HOSTILE]  # the strings themselves, as text
    label = browser.find_element(By.CSS_SELECTOR, 'g.qg-node[data-id="1_3_1"]').get_attribute("data-label")
    assert label == HOSTILE[1]


@pytest.fixture(scope="module")
def tiny_graph(tmp_path_factory) -> AttributionGraph:
    """The tiny Qwen3.5's graph of "the cat sat on the mat" through random transcoders (its tokens decoded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import qgraph
    from qgraph.testing import cached_tiny_qwen3_5, write_transcoders

    path = cached_tiny_qwen3_5()
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    ids = tokenizer("the cat sat on the mat", return_tensors="pt")["input_ids"][0]
    folder = write_transcoders(tmp_path_factory.mktemp("transcoders"), d_model=64, layers=4, d_transcoder=8, skip=True)
    return qgraph.attribution_graph(model, ids, folder, tokenizer=tokenizer).prune()


@pytest.mark.slow
def test_the_tiny_models_graph_pinned_in_the_viewer_and_as_a_paper_figure(browser, tiny_graph, tmp_path):
    """The pictures of docs/gallery (written there with QGRAPH_SCREENSHOTS=1): the viewer with a node pinned,
    and the graphviz figure, bounded in width."""
    from PIL import Image
    from selenium.webdriver.common.action_chains import ActionChains

    out = ROOT / "docs" / "gallery" if os.environ.get("QGRAPH_SCREENSHOTS") == "1" else tmp_path
    page = tiny_graph.plot().save(tmp_path / "tiny.html")
    print(f"the tiny model's graph: {page.stat().st_size:,} bytes of HTML, {len(tiny_graph.nodes)} nodes, "
          f"{int(tiny_graph.edge_mask.sum())} edges")
    browser.set_window_size(1400, 860)  # a viewport of about 1400 x 720
    browser.get(page.as_uri())
    ids = [n.node_id for n in tiny_graph.nodes]
    i = max((k for k, n in enumerate(tiny_graph.nodes) if n.kind == "feature" and n.layer > 0),
            key=lambda k: int(tiny_graph.edge_mask[k].sum() + tiny_graph.edge_mask[:, k].sum()))
    ActionChains(browser).click(glyph(browser, ids[i])).perform()
    neighbours = {ids[k] for k in (tiny_graph.edge_mask[i] | tiny_graph.edge_mask[:, i]).nonzero().flatten().tolist()}
    assert shown_nodes(browser) == neighbours | {ids[i]}
    assert console_errors(browser) == []
    browser.save_screenshot(str(out / "attribution-viewer.png"))
    browser.set_window_size(1400, 1000)

    dot = tiny_graph.to_graphviz()
    (out / "attribution-tiny.svg").write_bytes(dot.pipe("svg"))
    with Image.open(io.BytesIO(dot.pipe("png"))) as image:
        assert image.size[0] < 1400, image.size  # was 4466 x 368 (18324 wide on this prompt)
        image.convert("RGB").quantize(256).save(out / "attribution-tiny.png", optimize=True)
