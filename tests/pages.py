"""Reading qgraph's pages in tests: the hover data of a figure's HTML (``hover_grids``), and headless
Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by ``selenium``): the ``browser`` fixture
(import it into a test module) and the browser's console errors. Without Chromium or selenium the tests
that use the browser skip."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or not Path(CHROMEDRIVER).exists():
        pytest.skip("no chromium / chromium-driver here (Debian: apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def console_errors(driver) -> list:
    """What the page logged as an error (a script that failed, a resource it could not load)."""
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def hover_grids(page: str) -> list[dict]:
    """The hover data of a figure's HTML (``qgraph/plots/hover.py``): one grid per hit rect, with ``cells``,
    its values as the tooltip shows them, row by row."""
    found = re.search(r'<script type="application/json" class="qg-grids">(.*?)</script>', page, re.S)
    assert found, "the page carries no hover data"
    grids = json.loads(found.group(1))  # the page writes "</" as "<\\/", which JSON reads back
    for grid in grids:
        grid["cells"] = grid["values"].split(" ")
    return grids


def hover(driver, element, fx: float, fy: float) -> None:
    """The pointer at ``(fx, fy)`` of ``element``'s box (fractions from its top left corner)."""
    from selenium.webdriver.common.action_chains import ActionChains
    box = element.rect
    ActionChains(driver).move_to_element_with_offset(element, int((fx - 0.5) * box["width"]),
                                                     int((fy - 0.5) * box["height"])).perform()
