"""The tour page (tour.md), generated from docs/tour.ipynb as it runs now.

The build executes the notebook (``nbclient`` on an IPython kernel, in a temporary folder), so the
page shows the outputs the code gives today, never ones saved by hand; a cell that raises fails the
build. Markdown cells as they are, code cells as Python blocks, then each cell's outputs: text as text
blocks, pictures inline (PNG as data URIs), and HTML (qgraph's pictures and the explorer, each
self-contained) in an ``<iframe srcdoc>`` of its own, so its scripts and styles stay out of the page's.
What a cell writes to stderr (progress bars, warnings) is left out.

``QGRAPH_DOCS_TOUR=saved`` renders the outputs saved in the notebook instead (none, as committed): for
builds that test something else. tests/test_tour.py runs the notebook and opens its pictures too.
"""
from __future__ import annotations

import html
import json
import os
import tempfile
import time
from pathlib import Path

from mkdocs.structure.files import File

NOTEBOOK = Path(__file__).resolve().parent.parent / "tour.ipynb"
# sized to its document once loaded (a srcdoc frame is same-origin, so the page may read its height)
FRAME = ('<iframe class="qgraph-output" style="width:100%;border:0" srcdoc="{}" '
         'onload="this.style.height=(this.contentDocument.documentElement.scrollHeight+20)+\'px\'"></iframe>')


def _text(lines) -> str:
    return "".join(lines) if isinstance(lines, list) else lines


def _outputs(cell) -> list[str]:
    parts = []
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        if "text/html" in data:
            parts.append(FRAME.format(html.escape(_text(data["text/html"]), quote=True)))
        elif "image/png" in data:
            parts.append(f"![output](data:image/png;base64,{_text(data['image/png']).strip()})")
        elif output.get("output_type") == "error":
            raise RuntimeError(f"the tour's cell raised {output.get('ename')}: {output.get('evalue')}")
        elif (output.get("output_type") == "stream" and output.get("name") == "stdout") or "text/plain" in data:
            text = _text(output.get("text", data.get("text/plain", ""))).rstrip()
            if text:
                parts.append("```text\n" + text.replace("```", "'''") + "\n```")
    return parts


def executed() -> list[dict]:
    """The notebook's cells with the outputs of running it now (or as saved, see the module's doc)."""
    if os.environ.get("QGRAPH_DOCS_TOUR") == "saved":
        return json.loads(NOTEBOOK.read_text())["cells"]
    import nbclient
    import nbformat

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qgraph-tour-") as folder:
        nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": folder}}).execute()
    print(f"docs: the tour notebook ran in {time.perf_counter() - start:.1f} s")
    return notebook.cells


def page(cells) -> str:
    parts = []
    for cell in cells:
        source = _text(cell["source"]).rstrip()
        if cell["cell_type"] == "markdown":
            parts.append(source)
        elif cell["cell_type"] == "code" and source:
            parts.append("```python\n" + source + "\n```")
            parts += _outputs(cell)
    parts.append("*This page is [tour.ipynb](tour.ipynb) as the build ran it; run it in Jupyter to explore.*")
    return "\n\n".join(parts) + "\n"


def on_files(files, config):
    files.append(File.generated(config, "tour.md", content=page(executed())))
    return files
