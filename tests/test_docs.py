"""The docs site (issue 40): built offline with ``mkdocs build --strict``, opened in headless Chromium.

The build fails on a warning (a broken link or anchor, a page outside the nav), on a public name or a
public method with no docstring, and on a public name in no API page (docs/hooks/api.py). The built
site loads nothing from the network; the generated pages hold what they are generated from.
"""
from __future__ import annotations

import functools
import http.server
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.chromium import browser, console_errors  # noqa: F401 (browser: a fixture)

pytestmark = pytest.mark.slow  # the site built by mkdocs in a subprocess and opened in Chromium (python -m pytest -m slow)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                                              "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    print(f"docs site built in {time.perf_counter() - start:.1f} s")
    return out


def _build_fails_with(tmp_path, page: str, text: str) -> str:
    """``mkdocs build --strict`` of a copy of the docs with ``page`` holding ``text``: its output."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "results.md", tmp_path / "benchmarks" / "results.md")
    (tmp_path / "docs" / page).write_text((tmp_path / "docs" / page).read_text() + text)
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "QGRAPH_DOCS_TOUR": "saved"})  # links, not the tour
    assert result.returncode != 0, "the build passed"
    return result.stdout + result.stderr


def test_a_broken_link_fails_the_build(tmp_path):
    assert "no-such-page.md" in _build_fails_with(tmp_path, "index.md", "\n[gone](no-such-page.md)\n")


def test_every_public_name_has_a_docstring_and_an_api_entry(site):
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import api
    finally:
        sys.path.pop(0)
    import qgraph
    assert api.undocumented() == []
    html = "".join(path.read_text() for path in (site / "api").glob("*.html"))
    for name in qgraph.__all__:
        value = getattr(qgraph, name)
        assert f'id="{value.__module__}.{value.__qualname__}"' in html, f"{name} has no anchor in the API reference"


def test_the_catalogue_is_the_families_values(site):
    from qgraph.families import FAMILIES
    html = (site / "catalogue.html").read_text()
    for family in FAMILIES:
        for spec in family.values:
            host = family.hosts[spec.host]
            assert f"<code>{host + '.' if host else ''}{spec.name}</code>" in html, (family.name, spec.name)


def test_the_site_loads_nothing_from_the_network(site):
    for page in site.rglob("*.html"):
        text = page.read_text()
        remote = re.findall(r'(?:src|href)="(https?://[^"]+)"', text)
        assert not [url for url in remote if not url.startswith(("https://github.com", "https://huggingface.co"))
                    and ("font" in url or url.endswith((".js", ".css")))], (page, remote)
        assert "fonts.googleapis" not in text and "cdn." not in text, page


@pytest.fixture(scope="module")
def served(site):
    """The built site on 127.0.0.1 (the search runs in a web worker, which a file:// page cannot start)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("page, text", [("index.html", "standard value"), ("deltanet.html", "initial_state_output"),
                                        ("catalogue.html", "effective_attention"), ("api/circuits.html", "attribution_graph")])
def test_a_page_renders_in_chromium(served, browser, page, text):
    from selenium.webdriver.common.by import By
    browser.get(f"{served}/{page}")
    body = browser.find_element(By.CSS_SELECTOR, "article").text
    assert text in body
    assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []


def test_the_tour_page_shows_the_outputs_the_notebook_gives_now(served, browser):
    """The build ran the notebook: its pictures are on the page, each in its frame, drawn."""
    from selenium.webdriver.common.by import By
    browser.get(f"{served}/tour.html")
    frames = browser.find_elements(By.CSS_SELECTOR, "iframe.qgraph-output")
    assert len(frames) == 4  # the output's table, the pattern, the decays, the explorer
    shown = []
    for frame in frames:
        browser.switch_to.frame(frame)
        shown.append(browser.find_element(By.TAG_NAME, "body").text)
        browser.switch_to.default_content()
    assert "layers.3.self_attn.attention_probabilities" in shown[0]
    assert "head 3" in shown[1] and "layers.3.self_attn.attention_probabilities" in shown[1]
    assert "layers.0.linear_attn.decays" in shown[2]
    assert all(frame.size["height"] > 100 for frame in frames)
    assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []


def test_the_search_box_finds_attribution_graph(served, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    browser.get(f"{served}/index.html")
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    box.click()
    box.send_keys("attribution_graph")
    WebDriverWait(browser, 20).until(
        lambda driver: driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item"))
    results = " ".join(item.text for item in browser.find_elements(By.CSS_SELECTOR, ".md-search-result__item"))
    assert "attribution_graph" in results
    assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []
