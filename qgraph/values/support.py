"""What a model supports: the support table and the module tree annotated with standard values."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .catalogue import Entry
from ..families import family_for
from ..reprs import Summary, blocks_text
from .names import normalize

if TYPE_CHECKING:  # a type only: transformers is imported with the model
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class Row:
    """One standard value across its hosts: ``blocks`` maps block index (None for the model) to
    None where the value is available and to the reason where it is not."""

    name: str  # "layers.{i}.self_attn.attention_scores"
    layout: str
    shape: tuple
    description: str
    blocks: dict


class SupportTable:
    """Every standard value of a model with its layout, shape and per-block availability.

    ``table.rows`` lists them; ``table[name]`` gives one concrete value's ``Entry`` (ports
    included); ``table.ports`` lists the module ports; ``str(table)`` is a readable table, with the
    reason for each value unavailable, ``repr(table)`` a short one (and an HTML table in a notebook).
    """

    def __init__(self, catalogue: dict[str, Entry], family, config):
        self.catalogue = catalogue
        rows: dict[str, Row] = {}
        for entry in catalogue.values():
            if entry.spec is None:
                continue
            generic = re.sub(r"^layers\.\d+", "layers.{i}",
                             re.sub(r"^vision\.layers\.\d+", "vision.layers.{j}", entry.name))
            row = rows.setdefault(generic, Row(generic, entry.layout, entry.shape, entry.description, {}))
            numbered = re.match(r"^(?:vision\.)?layers\.(\d+)", entry.name)
            row.blocks[int(numbered.group(1)) if numbered else None] = entry.reason
        block_mixers, kinds = family.block_mixers(config), family.kinds(config)
        for row in rows.values():  # mixer values on the other kind's blocks
            mixer = row.name.split(".")[2] if row.name.startswith("layers.{i}.") else None
            for block, has in enumerate(block_mixers):
                if mixer in set(block_mixers) and has != mixer:
                    row.blocks[block] = (f"block {block} is a {kinds[block]} ({family.title(has)}) block: it has "
                                         f"{has}, not {mixer}")
        self.rows = list(rows.values())
        self.ports = [entry for entry in catalogue.values() if entry.spec is None]

    def __getitem__(self, name: str) -> Entry:
        return self.catalogue[normalize(name)]

    def to_rich(self):
        """The table as a ``rich.table.Table`` (``rich.print(table.to_rich())`` fits it to the terminal,
        wrapping the availability column, never the names)."""
        table = plain_table("value", "layout", "shape", "available")
        for row in self.rows:
            shape = "[" + " ".join(str(size) for size in row.shape) + "]"
            add_text_row(table, row.name, row.layout, shape, _availability(row))
        return table

    def footer(self) -> str:
        """The line under the table: how many module ports are available."""
        called = sum(entry.available for entry in self.ports)
        return (f"{called} module ports (<module>.input / <module>.output) of {len(self.ports)} are "
                f"available; table.ports lists them")

    def __str__(self) -> str:
        return f"{plain_text(self.to_rich())}\n\n{self.footer()}"

    def __repr__(self) -> str:  # short: a row per value, no reasons (print(table) has them)
        return _summary(self).text()

    def _repr_html_(self) -> str:
        return _summary(self).html()


def plain_table(*columns: str):
    """A borderless ``rich`` table with these column headers. The first column (names) never wraps;
    printed to a terminal narrower than the table, the other columns wrap at spaces (and fold a word
    longer than the column), so no text is ever cut off."""
    from rich import box
    from rich.table import Table
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for index, column in enumerate(columns):
        table.add_column(column, no_wrap=index == 0, overflow="fold")
    return table


def add_text_row(table, *cells) -> None:
    """Add a row of plain strings (no rich markup: ``[batch seq]`` stays as written)."""
    from rich.text import Text
    table.add_row(*(Text(str(cell)) for cell in cells))


def plain_text(renderable) -> str:
    """``renderable`` (a rich table) as plain text at its natural width: no colour, nothing wrapped,
    trailing spaces dropped; what ``str(table)`` and output to a file or pipe show."""
    import io

    from rich.console import Console
    text = io.StringIO()
    console = Console(file=text, width=100_000, color_system=None, force_terminal=False,
                      legacy_windows=False, soft_wrap=False)
    console.print(renderable)
    return "\n".join(line.rstrip() for line in text.getvalue().splitlines())


def _availability(row: Row) -> str:
    if list(row.blocks) == [None]:
        reason = row.blocks[None]
        return "yes" if reason is None else f"no: {reason}"
    yes = [block for block, reason in sorted(row.blocks.items()) if reason is None]
    no: dict[str, list[int]] = {}
    for block, reason in sorted(row.blocks.items()):
        if reason is not None:
            no.setdefault(reason.replace(f"block {block} ", "the block "), []).append(block)
    text = f"blocks {_ranges(yes)}" if yes else "none"
    for reason, blocks in no.items():
        text += f"; not {_ranges(blocks)}: {reason}"
    return text


def _ranges(blocks: list[int]) -> str:
    return ",".join(str(b) for b in blocks)


def support(model: PreTrainedModel) -> SupportTable:
    """The support table of ``model``: every standard value, its layout and shape, and per block
    whether it is available here, with the reason where it is not."""
    from ..export import export_model  # lazy: keeps tqdm out until this is used
    from ..program import Program  # lazy: keeps tqdm out until this is used
    family_for(model)  # not a model qgraph knows: named before exporting
    exported = export_model(model)
    return SupportTable(Program(model, exported).catalogue, exported.family, model.config)


def annotated_tree(model: torch.nn.Module, catalogue: dict[str, Entry], highlight=frozenset()) -> str:
    """``print(model)``'s module tree with each module's standard values and their layouts under it.

    Values in ``highlight`` (the instrumented ones) are marked with ``*``.
    """
    family = family_for(model)
    by_host: dict[str, list[Entry]] = {}
    for entry in catalogue.values():
        if entry.spec is not None:
            by_host.setdefault(entry.host, []).append(entry)
    printed = set()

    def render(module: torch.nn.Module, path: str, indent: str) -> list[str]:
        extra = module.extra_repr()
        children = list(module.named_children())
        host = family.module_name(path)
        values = by_host.get(host, []) if host not in printed else []
        printed.add(host)
        if not children and not values:
            return [f"{type(module).__name__}({extra})"]
        lines = [f"{type(module).__name__}({extra}" if extra else f"{type(module).__name__}("]
        for name, child in children:
            child_lines = render(child, f"{path}.{name}" if path else name, indent + "  ")
            lines.append(f"{indent}  ({name}): {child_lines[0]}")
            lines.extend(child_lines[1:])
        for entry in values:
            mark = "*" if entry.name in highlight else ""
            status = "" if entry.available else f"  [unavailable: {entry.reason}]"
            local = entry.name[len(host) + 1:] if host else entry.name
            lines.append(f"{indent}  ({local}){mark} -> {entry.layout}: {entry.description}{status}")
        lines.append(f"{indent})")
        return lines

    return "\n".join(render(model, "", ""))


def _summary(table):
    """``SupportTable``: a row per standard value (layout, shape, where it is available)."""
    from collections import Counter

    rows, text_rows, counts = [], [], Counter()
    for row in table.rows:
        yes = [block for block, reason in row.blocks.items() if reason is None]
        where = "yes" if len(yes) == len(row.blocks) else "no" if not yes else \
            f"blocks {blocks_text([block for block in yes if block is not None])}"
        counts[where if where in ("yes", "no") else "some"] += 1
        layout_shape = "[" + " ".join(str(size) for size in row.shape) + "]"
        rows.append((row.name, row.layout, layout_shape, _availability(row)))
        text_rows.append((row.name, row.layout.split(" [")[0], layout_shape, where))
    ports = sum(entry.available for entry in table.ports)
    title = (f"SupportTable: {len(rows)} standard values ({counts['yes']} available everywhere, {counts['some']} on "
             f"some blocks, {counts['no']} unavailable), {len(table.ports)} module ports ({ports} available)")
    return Summary(title, ("value", "layout", "shape", "available"), rows,
                   ["print(table) also says why a value is unavailable; table.ports lists the module ports"], text_rows)
