"""The value catalogue page (catalogue.md), generated from the families qgraph registers.

Every family's standard values (and its vision tower's), each with its name pattern, layout, what it
is and how it may be used, read from ``Family.values`` and ``Family.images.values``: the page is the
families' own data, never a second copy typed by hand.
"""
from __future__ import annotations

from mkdocs.structure.files import File

INTRO = """# Value catalogue

Every standard value of every model family qgraph ships, generated from the families themselves
(`qgraph/families/`) when the site is built. A name's `{i}` is a text block, `{j}` a vision block;
`qgraph.support(model)` gives the same rows for one model, with the blocks where each is available.
*Editable* values take the [edits](api/edits.md); *by name* values are computed only when asked
for by their own name (a glob whose last part names them), as they change the block's kernel.
"""


def _name(family, spec) -> str:
    host = family.hosts[spec.host]
    return f"{host}.{spec.name}" if host else spec.name


def _use(spec) -> str:
    rule = spec.rule
    use = "read-only" if spec.read_only else ("editable (regions)" if rule.region_edits_only else "editable")
    return use + (", by name" if rule.by_name_only else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(family, specs) -> list[str]:
    rows = ["| value | layout | use | what it is |", "|---|---|---|---|"]
    for spec in specs:
        rows.append(f"| `{_name(family, spec)}` | `{spec.layout}` | {_use(spec)} | {_cell(spec.description)} |")
    return rows


def page() -> str:
    from qgraph.families import FAMILIES
    lines = [INTRO]
    for family in FAMILIES:
        lines += [f"## {family.name}", "", f"{family.classes}. Block kinds: "
                  + ", ".join(f"{kind} ({mixer.title}, `{mixer.module}`)" for kind, mixer in family.mixers.items())
                  + f". {len(family.values)} text values"
                  + (f", {len(family.images.values)} vision values." if family.images else "."), ""]
        lines += _table(family, family.values) + [""]
        if family.images:
            lines += [f"### {family.name}: the vision tower", ""] + _table(family, family.images.values) + [""]
    return "\n".join(lines)


def on_files(files, config):
    files.append(File.generated(config, "catalogue.md", content=page()))
    return files
