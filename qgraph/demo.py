"""``qgraph demo``: one screen on what qgraph does with a checkpoint. What it loaded (its blocks and
their kinds, the attention implementation, and for the embedded tiny checkpoint that its weights are
random, so its predictions are noise); a few values captured for a prompt with their statistics; one
edit (a head of the last attention block zeroed) and its effect on the next-token logits, computed;
and where to go next. The long forms, the support table and the annotated module tree, are the
command's ``--table`` and ``--tree`` (``qgraph/cli.py`` prints them).

Every number printed is computed here from the calls shown; tests/test_demo.py recomputes them apart.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from .compat import attn_implementation
from .edits import Zero
from .errors import InternalError
from .families import Mixer, family_for
from .instrument import InstrumentedModel, instrument
from .reprs import blocks_text
from .values.support import add_text_row, plain_table, plain_text

HEAD = 0  # the head the demo's edit zeroes
NEXT = [("qgraph demo --table", "every standard value: layout, shape, blocks that have it"),
        ("qgraph demo --tree", "the module tree, each module annotated with its values"),
        ("qgraph support --model PATH", "the value table of your own checkpoint"),
        ("qgraph render --block {block} --out block{block}.svg", "block {block} drawn with every value on it"),
        ("docs/getting-started.md", "then values.md, edits.md, cli.md: the repository's docs")]


def block_mixers(model) -> list[Mixer]:
    """The token mixer of each text block, as the model's family says (``Family.mixers``)."""
    family = family_for(model)
    return [family.mixers[kind] for kind in family.kinds(model.config)]


def default_values(mixers: list[Mixer]) -> list[str]:
    """What the demo captures unless ``--values`` says: the residual stream at up to four blocks (the
    first, the last, evenly between), the first recurrent (DeltaNet) block's decays, the last attention
    block's pattern and ``next_token_probs``: a table of at most eight rows, whatever the model's size."""
    blocks = sorted({round(i * (len(mixers) - 1) / 3) for i in range(4)})
    values = [f"layers.{block}.layer_output" for block in blocks]
    recurrent = next((block for block, mixer in enumerate(mixers) if mixer.recurrent), None)
    if recurrent is not None:
        values.append(f"layers.{recurrent}.{mixers[recurrent].module}.decays")
    attention = last_attention(mixers)
    if attention is not None:
        values.append(f"layers.{attention}.{mixers[attention].module}.attention_probabilities")
    return values + ["next_token_probs"]


def last_attention(mixers: list[Mixer]) -> int | None:
    """The index of the last attention block (a mixer that keeps a key/value cache; None if none)."""
    found = [block for block, mixer in enumerate(mixers) if not mixer.recurrent]
    return found[-1] if found else None


def edited_value(mixers: list[Mixer], catalogue) -> str | None:
    """The value the demo's edit zeroes a head of: the last attention block's per-head outputs."""
    block = last_attention(mixers)
    if block is None:
        return None
    name = f"layers.{block}.{mixers[block].module}.attention_head_outputs"
    return name if name in catalogue else None


def short_path(path, width: int = 60) -> str:
    """``path`` for a line of the screen: the home folder as ``~``, and only its end past ``width`` characters."""
    text = str(path)
    home = str(Path.home())
    if text.startswith(home + os.sep):
        text = "~" + text[len(home):]
    return text if len(text) <= width else "…" + text[-(width - 1):]


class Demo:
    """The demo of one loaded model: ``instrument`` it (``values`` None: ``default_values``), then
    ``lines(prompt)`` runs the prompt, plain and with the edit, and says what came out. ``embedded``: the
    model is the embedded tiny checkpoint (random weights, which the screen says)."""

    def __init__(self, model, tokenizer, path, values=None, embedded: bool = False):
        self.model, self.tokenizer, self.path, self.embedded = model, tokenizer, path, embedded
        self.kinds = family_for(model).kinds(model.config)
        self.mixers = block_mixers(model)
        start = time.perf_counter()
        self.ig: InstrumentedModel = instrument(model, values=values or default_values(self.mixers))
        self.seconds = time.perf_counter() - start
        self.edited = edited_value(self.mixers, self.ig.catalogue)

    def lines(self, prompt: str) -> list[str]:
        """The demo's screen for ``prompt``."""
        inputs = self.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = self.ig(**inputs)
        tokens = inputs["input_ids"].shape[1]
        lines = [*self.loaded(), "", f"captured for {prompt!r} ({tokens} tokens):"]
        lines += plain_text(value_table(out.values)).splitlines()
        top = probabilities(out).topk(5)
        lines.append("next token: " + ", ".join(f"{self.token(i)!r} {p:.3f}"
                                                for i, p in zip(top.indices.tolist(), top.values.tolist())))
        if self.edited is not None:
            lines += ["", *self.edit_effect(self.edited, inputs, last_logits(out))]
        block = last_attention(self.mixers)
        block = 0 if block is None else block
        lines += ["", "next:", *(f"  {command.format(block=block):<42}{what.format(block=block)}"
                                 for command, what in NEXT)]
        return lines

    def loaded(self) -> list[str]:
        """What was loaded: the checkpoint, its blocks and kinds, its attention, the instrument."""
        config = self.model.config.get_text_config()
        where = {kind: [block for block, k in enumerate(self.kinds) if k == kind] for kind in dict.fromkeys(self.kinds)}
        titles = {kind: mixer.title for kind, mixer in zip(self.kinds, self.mixers)}
        blocks = ", ".join(f"{blocks_text(indices)} {kind} ({titles[kind]})" for kind, indices in where.items())
        attention = attn_implementation(self.model.config)
        opening = f"checkpoint: {'the embedded tiny Qwen3.5 at ' if self.embedded else ''}"
        lines = [opening + short_path(self.path, 100 - len(opening)),
                 f"  {type(self.model).__name__}, hidden size {config.hidden_size}, vocabulary {config.vocab_size}, "
                 f"attention {attention}",
                 f"  {len(self.kinds)} blocks: {blocks}"]
        if self.embedded:
            lines += ["  Its weights are random, so its predictions are noise: this shows what qgraph reads and",
                      "  edits, not what a trained model knows. --model PATH runs a real checkpoint."]
        return lines + [f"qgraph.instrument(model, values=[...]): {self.seconds:.1f} s, {len(self.ig.values)} values"]

    def edit_effect(self, name: str, inputs, logits: torch.Tensor) -> list[str]:
        """Zero head ``HEAD`` of the value ``name``: the edit, as code, and how it moves ``logits``, the
        last position's next-token logits."""
        with torch.no_grad():
            edited = last_logits(self.ig(**inputs, edits={name: Zero(heads=[HEAD])}))
        heads, block = self.ig.catalogue[name].shape[2], name.split(".")[1]
        top = int(logits.argmax())
        change = edited - logits
        largest = int(change.abs().argmax())
        after = int(edited.argmax())
        return [f"edit: zero head {HEAD} of block {block}'s attention ({heads} heads), at every position:",
                f"  ig(**inputs, edits={{{name!r}: qgraph.Zero(heads=[{HEAD}])}})",
                f"  last position: logit of {self.token(top)!r} {logits[top]:.4f} -> {edited[top]:.4f} "
                f"({change[top]:+.4f}); top token after: {self.token(after)!r}",
                f"  largest logit change: {change[largest]:+.4f} (of {self.token(largest)!r}), over "
                f"{change.numel()} tokens"]

    def token(self, index: int) -> str:
        return self.tokenizer.decode([index])


def last_logits(out) -> torch.Tensor:
    """The first prompt's next-token logits (at its last position)."""
    if out.logits is None:
        raise InternalError("the demo's instrument returned no logits; it is built with logits=True")
    return out.logits[0, -1]


def probabilities(out) -> torch.Tensor:
    """The next-token probabilities of the first prompt: ``next_token_probs`` where captured, else the logits'."""
    return out["next_token_probs"][0] if "next_token_probs" in out.values else out.logits[0, -1].float().softmax(-1)


def value_table(values: dict):
    """A rich table of captured values: shape, how many entries are masked (-inf, NaN or the dtype's
    lowest value, as attention masks write), and mean, std and max |x| over the other entries; a value
    that is not a tensor (``input_size``, a ``torch.Size``) shows as it is, ``value (1, 9)``."""
    table = plain_table("value", "shape", "masked", "mean", "std", "max |x|")
    for column in table.columns[2:]:
        column.justify = "right"
    for name, value in values.items():
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            shapes = ", ".join(str(tuple(v.shape)) for v in value)  # per-image patterns: a list of tensors
            add_text_row(table, name, f"[{shapes}]", "", "", "", "")
            continue
        if not isinstance(value, torch.Tensor):  # a plain value (input_size, a torch.Size): shown as it is
            shown = str(tuple(value)) if isinstance(value, torch.Size) else str(value)
            add_text_row(table, name, f"value {shown}", "", "", "", "")
            continue
        add_text_row(table, name, str(tuple(value.shape)), *value_statistics(value))
    return table


def value_statistics(value) -> tuple[str, str, str, str]:
    """(masked count, mean, std, max |x|) of a tensor as text; the statistics skip the masked entries."""
    x = value.detach().float() if value.is_floating_point() else value.detach().double()
    masked = ~x.isfinite()
    if value.is_floating_point():
        masked |= value.detach() <= torch.finfo(value.dtype).min
    kept = x[~masked].double()
    if kept.numel() == 0:
        return str(int(masked.sum())), "-", "-", "-"
    std = kept.std().item() if kept.numel() > 1 else 0.0
    return (str(int(masked.sum())), f"{kept.mean().item():.4f}", f"{std:.4f}", f"{kept.abs().max().item():.4f}")
