"""The tour page (tour.md), generated from docs/tour.ipynb and the outputs saved in it.

Markdown cells as they are, code cells as Python blocks, then each cell's saved outputs: text as text
blocks, pictures inline (PNG as data URIs, so the page needs no other file). An HTML output (the
explorer's widget) is left to the notebook itself: its scripts belong to a notebook front end.
The notebook's code runs in tests/test_tour.py.
"""
from __future__ import annotations

import json
from pathlib import Path

from mkdocs.structure.files import File

NOTEBOOK = Path(__file__).resolve().parent.parent / "tour.ipynb"


def _text(lines) -> str:
    return "".join(lines) if isinstance(lines, list) else lines


def _outputs(cell) -> list[str]:
    parts = []
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        if "image/png" in data:
            parts.append(f"![output](data:image/png;base64,{_text(data['image/png']).strip()})")
        elif output.get("output_type") == "stream" or "text/plain" in data:
            text = _text(output.get("text", data.get("text/plain", ""))).rstrip()
            if text and "text/html" not in data:
                parts.append("```text\n" + text.replace("```", "'''") + "\n```")
    return parts


def page() -> str:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    parts = []
    for cell in cells:
        source = _text(cell["source"]).rstrip()
        if cell["cell_type"] == "markdown":
            parts.append(source)
        elif cell["cell_type"] == "code" and source:
            parts.append("```python\n" + source + "\n```")
            parts += _outputs(cell)
    parts.append("*This page is [tour.ipynb](tour.ipynb) as saved; run it in Jupyter to explore.*")
    return "\n\n".join(parts) + "\n"


def on_files(files, config):
    files.append(File.generated(config, "tour.md", content=page()))
    return files
