"""The benchmarks page: benchmarks.md, with benchmarks/results.md (the measured figures) put in at its marker.

The figures are written once, where the benchmarks write them; the page is that file as it is.
"""
from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results.md"
MARKER = "<!-- benchmarks/results.md -->"


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    results = RESULTS.read_text()
    body = results.split("\n", 1)[1] if results.startswith("# ") else results  # the page has its own title
    return markdown.replace(MARKER, body.replace("\n#", "\n##"))
