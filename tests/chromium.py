"""Headless Chromium for the tests that open pages: Debian's ``chromium`` and ``chromium-driver``, driven by
``selenium``. A test module takes the ``browser`` fixture with ``from tests.chromium import browser``
(one browser a module), and is marked ``slow`` (it starts a process of its own)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium 1400x1000 that keeps its console log (skipped where there is none)."""
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
    """The browser console's errors since the last call."""
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
