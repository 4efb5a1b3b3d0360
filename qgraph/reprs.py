"""Short reprs for terminals and notebooks: a header line and a table, never tensor data.

Every repr here is a ``Summary`` (a title, column names, rows, notes) shown two ways: ``text()`` is
``repr(x)`` (with ``merge``, a value captured at several blocks with one shape and dtype is one row,
``layers.{0-2}.linear_attn.decays``, and a note under the table says so, only where it shows such a
row) and ``html()`` is ``x._repr_html_()``, what Jupyter shows: a self-contained table (inline
styles, no stylesheet, script or font to fetch) with a row per value.
The functions below build the summaries of an ``Output``, an ``InstrumentedModel``, a
``SupportTable``, a ``GenerateOutput`` and a loaded capture (``qgraph.load_capture``).
"""
from __future__ import annotations

import html
import re
from collections import Counter
from dataclasses import dataclass, field

TEXT_ROWS = 50  # rows a text repr shows before "... N more"
_BLOCK = re.compile(r"^((?:vision\.)?layers)\.(\d+)(?=\.|$)")
_GROUP = re.compile(r"^(?:vision\.)?layers\.\{([\d,-]+)\}")  # a row ``merged`` made of several blocks' rows


@dataclass
class Summary:
    """A title, a table (``columns`` empty: rows of ``(key, value)`` with no header) and notes under it."""

    title: str
    columns: tuple[str, ...] = ()
    rows: list[tuple] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    text_rows: list[tuple] | None = None  # what the text shows instead of ``rows`` (shorter cells)
    merge: bool = False  # the text shows rows alike but for their block index as one (``merged``)

    def text(self) -> str:
        rows = self.rows if self.text_rows is None else self.text_rows
        rows = [tuple(str(cell) for cell in row) for row in (merged(rows) if self.merge else rows)]
        shown = rows[:TEXT_ROWS]
        table = ([tuple(self.columns)] if self.columns else []) + shown
        lines = [self.title]
        if table:
            widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
            lines += [("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths))).rstrip()
                      for row in table]
        if len(rows) > len(shown):
            lines.append(f"  ... {len(rows) - len(shown)} more")
        return "\n".join(lines + self.notes + group_note(shown))

    def html(self) -> str:
        cell = "padding:1px 10px 1px 0;text-align:left;vertical-align:top;white-space:nowrap"
        head = "".join(f'<th style="{cell};border-bottom:1px solid #999">{html.escape(c)}</th>' for c in self.columns)
        body = "".join("<tr>" + "".join(f'<td style="{cell}">{html.escape(str(c))}</td>' for c in row) + "</tr>"
                       for row in self.rows)
        notes = "".join(f'<div style="color:#666">{html.escape(note)}</div>' for note in self.notes)
        return (f'<div class="qgraph-summary" style="font-family:monospace;font-size:12px">'
                f'<div style="font-weight:bold;margin-bottom:4px">{html.escape(self.title)}</div>'
                f'<div style="max-height:32em;overflow:auto"><table style="border-collapse:collapse">'
                f'{f"<thead><tr>{head}</tr></thead>" if self.columns else ""}<tbody>{body}</tbody></table></div>'
                f'{notes}</div>')


def shown(summary):
    """``(__repr__, _repr_html_)`` of a class whose summary is ``summary(self)``."""
    return (lambda self: summary(self).text()), (lambda self: summary(self).html())


# -- cells -------------------------------------------------------------------------------------------------
def shape(value) -> str:
    """``[2 70 64]``; a ``torch.Size`` (``input_size``) or other tuple gives its length."""
    if hasattr(value, "shape"):
        return "[" + " ".join(str(size) for size in value.shape) + "]"
    return f"[{len(value)}]" if isinstance(value, (tuple, list)) else "-"


def dtype(value) -> str:
    return str(value.dtype).removeprefix("torch.") if hasattr(value, "dtype") else type(value).__name__


def blocks_text(blocks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for block in sorted(blocks):
        if runs and block == runs[-1][-1] + 1:
            runs[-1].append(block)
        else:
            runs.append([block])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)) for run in runs)


def merged(rows) -> list[tuple]:
    """Rows ``(name, *cells)`` whose names differ only in their block index and whose cells are equal,
    as one row named ``layers.{0-2,5}.rest`` at the place of the first."""
    groups: dict[tuple, list[int | None]] = {}  # None: a name with no block index (one row of its own)
    for name, *cells in rows:
        found = _BLOCK.match(name)
        key = (found.group(1), name[found.end():], tuple(cells)) if found else (name, None, tuple(cells))
        groups.setdefault(key, []).append(int(found.group(2)) if found else None)
    out = []
    for (head, rest, cells), blocks in groups.items():
        indices = [block for block in blocks if block is not None]  # all of them where the name has one (rest)
        name = head if rest is None else f"{head}.{indices[0]}{rest}" if len(indices) == 1 \
            else f"{head}.{{{blocks_text(indices)}}}{rest}"
        out.append((name, *cells))
    return out


def group_note(rows) -> list[str]:
    """The note that explains the first of ``rows`` that stands for several blocks (none where no row does)."""
    for name, *_ in rows:
        found = _GROUP.match(name)
        if found:
            return [f"({name}: one row for blocks {found.group(1)}, alike in every other column)"]
    return []


def names_text(names, limit: int = 160) -> str:
    """Names merged across blocks, joined, cut at about ``limit`` characters."""
    parts = [row[0] for row in merged((name,) for name in names)]
    text, shown_parts = "", 0
    for part in parts:
        if text and len(text) + len(part) > limit:
            return f"{text}, ... ({len(parts) - shown_parts} more)"
        text, shown_parts = f"{text}, {part}" if text else part, shown_parts + 1
    return text or "none"


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GB"


# -- what each class shows ---------------------------------------------------------------------------------
def output(out) -> Summary:
    """``Output``: the logits, and a row per value (name, shape, dtype)."""
    rows = [(name, shape(value), dtype(value)) for name, value in out.values.items()]
    devices = sorted({str(value.device) for value in out.values.values() if hasattr(value, "device")})
    logits = "no logits" if out.logits is None else f"logits {shape(out.logits)} {dtype(out.logits)}"
    title = (f"Output: {logits}, {len(rows)} values" + (f" on {', '.join(devices)}" if devices else "")
             + (f", {len(out.watched)} with gradients (out.grad(name))" if out.watched else ""))
    return Summary(title, ("value", "shape", "dtype"), rows, merge=True)


def instrumented(ig) -> Summary:
    """``InstrumentedModel``: the model, its blocks, the values asked, slots, SAEs, compiled or not."""
    kinds = ig.family.kinds(ig.config)
    program = ig.program_for(ig.exported.images)  # built with the instrument: nothing is exported here
    fixed = [name for name, slot in ig.slots.items() if getattr(slot, "fixed", None) is not None]
    runner = program.runner
    rows = [("values", f"{len(ig.values)}: {names_text(ig.values)}"),
            ("edit slots",
             f"{len(ig.slots)}: {names_text(ig.slots)}" if ig.slots else "none (ig(..., edits=) adds them per call)"),
            *([("fixed edits", names_text(fixed))] if fixed else []),
            ("logits", "yes" if program.returns_logits else "no (values only)"),
            ("SAEs", f"{len(ig.saes)}: {names_text(ig.saes)}" if ig.saes else "none"),
            ("transcoders",
             f"{len(ig.transcoders)}: {', '.join(map(str, ig.transcoders))}" if ig.transcoders else "none"),
            ("compiled", ("yes (compiled)" if runner.called else "yes (compiles on the first call)")
             if runner.name == "compiled" else "no"),
            *([("stages", str(runner.stages))] if runner.name == "staged" else [])]
    counts = ", ".join(f"{count} {kind}" for kind, count in Counter(kinds).items())
    title = f"InstrumentedModel of {type(ig.model).__name__} (family {ig.family.name}, {len(kinds)} blocks: {counts})"
    return Summary(title, (), rows, ["ig.tree(): the module tree annotated with every standard value"])


instrumented_repr, instrumented_html = shown(instrumented)


def generated(gen) -> Summary:
    """``GenerateOutput``: the sequences, the steps and the values each step holds."""
    new = len(gen.scores)
    first = gen.steps[0] if gen.steps else {}
    later = gen.steps[1] if len(gen.steps) > 1 else {}
    rows = [(name, shape(value), shape(later[name]) if name in later else "-", dtype(value))
            for name, value in dict.items(first)]
    title = (f"GenerateOutput: sequences {shape(gen.sequences)} ({gen.sequences.shape[1] - new} prompt + {new} new "
             f"tokens), {len(gen.steps)} steps (0: the prompt pass, k: the pass over new token k), "
             f"{len(rows)} values per step")
    notes = ["out.steps[k][name] reads one; out.stacked(name) stacks one over the steps"]
    return Summary(title, ("value", "step 0", "steps 1+", "dtype"), rows, notes, merge=True)


def capture(cap) -> Summary:
    """A loaded capture: where, its rows, shards and values."""
    manifest, identity = cap.manifest, cap.manifest["identity"]
    rows = [(value["name"], value["layout"], identity.get("dtype", "-")) for value in identity["values"]]
    title = (f"Capture at {cap.out}: {len(cap)} rows of {identity.get('context', '?')} tokens "
             f"({manifest.get('tokens', 0)} real), {len(rows)} values, {_count(len(manifest['shards']), 'shard')} "
             f"({_size(manifest.get('bytes', 0))}), from {identity.get('model', {}).get('class', '?')}")
    notes = ["cap[i][name] reads a row; cap.values(name) one value over every row"]
    return Summary(title, ("value", "layout", "dtype"), rows, notes, merge=True)
