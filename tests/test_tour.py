"""The tour notebook (docs/tour.ipynb) runs on a real kernel, and its pictures work in a real browser.

The notebook is executed by ``nbclient`` on an IPython kernel; the HTML each picture cell shows is
opened in headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by ``selenium``):
the pattern's axes carry the prompt's tokens, each page shows a picture, the browser's console logs
no error, and a click on an explorer value fills ``#detail``. Screenshots are written to a tmp dir, or
to ``docs/gallery/`` with ``QGRAPH_SCREENSHOTS=1``.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.pages import browser, console_errors, hover  # noqa: F401 - browser is a fixture

pytestmark = pytest.mark.slow  # the notebook run on a Jupyter kernel and opened in Chromium (python -m pytest -m slow)

ROOT = Path(__file__).resolve().parent.parent
TOUR = ROOT / "docs" / "tour.ipynb"

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


def _prompt_tokens() -> list[str]:
    """The tour's prompt as the tiny checkpoint's tokenizer cuts it (the kernel built the checkpoint)."""
    from transformers import AutoTokenizer

    from qgraph.testing import cached_tiny_qwen3_5
    tokenizer = AutoTokenizer.from_pretrained(cached_tiny_qwen3_5())
    return [tokenizer.decode([t]) for t in tokenizer("the cat sat on the mat")["input_ids"]]


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    """The executed notebook (its kernel builds the tiny model where the session's tests built theirs)."""
    notebook = nbformat.read(TOUR, as_version=4)
    start = time.perf_counter()
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path_factory.mktemp("tour"))}}).execute()
    notebook.metadata["qgraph_seconds"] = time.perf_counter() - start
    return notebook


def _html(notebook, source: str) -> str:
    """The HTML the code cell whose source contains ``source`` displayed."""
    cell = next(cell for cell in notebook.cells if cell.cell_type == "code" and source in cell.source)
    html = [output["data"]["text/html"] for output in cell.outputs if "text/html" in output.get("data", {})]
    assert html, f"the cell {source!r} showed no HTML"
    return html[-1]


def test_the_tour_runs_and_each_picture_cell_shows_self_contained_html(tour):
    errors = [output for cell in tour.cells if cell.cell_type == "code" for output in cell.outputs
              if output.get("output_type") == "error"]
    assert errors == []
    for source in ("out = ig(**batch)", 'out.plot("layers.3', 'out.plot("layers.0', "qgraph.explore"):
        html = _html(tour, source)
        assert "<script src" not in html and "<link" not in html and "@import" not in html
        assert "https://" not in html and "http://" not in html.replace('"http://www.w3.org/2000/svg"', "")
    # the output's repr is a table of the values, not their numbers
    assert "layers.3.self_attn.attention_probabilities" in _html(tour, "out = ig(**batch)")
    print(f"tour: {tour.metadata['qgraph_seconds']:.1f} s on its kernel")


def _page(tmp_path: Path, name: str, html: str) -> Path:
    path = tmp_path / f"{name}.html"
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'></head><body>{html}</body></html>")
    return path


def _screenshots() -> Path | None:
    return ROOT / "docs" / "gallery" if os.environ.get("QGRAPH_SCREENSHOTS") == "1" else None


@pytest.mark.parametrize("cell, stem", [('out.plot("layers.3', "tour-pattern"), ('out.plot("layers.0', "tour-decays")])
def test_a_plot_shows_its_picture_in_a_browser_labelled_with_the_prompt(tour, browser, tmp_path, cell, stem):
    from selenium.webdriver.common.by import By
    browser.get(_page(tmp_path, stem, _html(tour, cell)).as_uri())
    errors = console_errors(browser)
    svg = browser.find_element(By.CSS_SELECTOR, "svg")
    assert svg.size["width"] > 100 and svg.size["height"] > 100
    labels = [element.text for element in browser.find_elements(By.CSS_SELECTOR, "svg text")]
    # the tiny tokenizer reads characters: the prompt's tokens label an axis in order ("c", "a", "t", ...)
    words = [t for t in _prompt_tokens() if t.strip()]
    assert " ".join(words) in " ".join(label for label in labels if label.strip()), labels[:40]
    assert errors == []
    target = (_screenshots() or tmp_path) / f"{stem}.png"
    assert svg.screenshot(str(target)) and target.stat().st_size > 1000


def test_a_click_on_an_explorer_value_fills_the_detail(tour, browser, tmp_path):
    from selenium.webdriver.common.by import By
    browser.get(_page(tmp_path, "tour-explore", _html(tour, "qgraph.explore")).as_uri())
    detail = browser.find_element(By.ID, "detail")
    before = detail.text
    value = browser.find_element(By.CSS_SELECTOR, '[data-value="layers.0.linear_attn.decays"]')
    browser.execute_script("arguments[0].scrollIntoView();", value)
    browser.execute_script(
        "arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true, cancelable: true}));", value)
    detail = browser.find_element(By.ID, "detail")
    assert detail.text != before and "layers.0.linear_attn.decays" in detail.text
    assert detail.find_elements(By.CSS_SELECTOR, "svg"), "the captured value's plot is not in #detail"
    image = detail.find_element(By.CSS_SELECTOR, "svg image")  # the plot answers a hover there too
    hover(browser, image, 0.5 / 9, 0.5 / 4)  # head 0 (top), the first token
    tip = detail.find_element(By.CSS_SELECTOR, ".qg-tip")
    assert tip.is_displayed() and "head 0" in tip.text and "decays" in tip.text
    assert console_errors(browser) == []
    target = (_screenshots() or tmp_path) / "tour-explore.png"
    browser.save_screenshot(str(target))
    assert target.stat().st_size > 1000
