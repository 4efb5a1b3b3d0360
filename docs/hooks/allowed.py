"""The page of what a saved program or a function edit may call: allowed.md, with qgraph/saved/allowed.py's
groups (each with its reason) put in at its marker, so the list a refusal points to is the one the code holds."""
from __future__ import annotations

MARKER = "<!-- qgraph/saved/allowed.py -->"


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    from qgraph.saved import allowed
    groups: dict[str, list[str]] = {}
    for name, reason in allowed.OPS.items():
        groups.setdefault(reason, []).append(name)
    lines = []
    for reason, names in groups.items():
        fresh = all(name in allowed.FRESH for name in names)
        lines += [f"**{reason[0].upper()}{reason[1:]}**{'' if fresh else ' (results may alias their inputs)'}", "",
                  ", ".join(f"`{name}`" for name in names), ""]
    lines += ["**The size arithmetic export writes between ops** (on symbolic sizes, never on tensors)", "",
              ", ".join(f"`{name}`" for name in allowed.FUNCTIONS), ""]
    return markdown.replace(MARKER, f"{len(allowed.OPS)} op overloads in {len(groups)} groups.\n\n" + "\n".join(lines))
