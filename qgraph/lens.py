"""The logit lens (``ig.logit_lens``): every block's read of the next token at every position, as a grid
blocks × positions, and its picture.

Each block's ``layer_output`` goes through the model's final norm and lm_head (``project_on_vocab``), as if
the model ended there. The grid keeps each cell's top tokens and their probabilities, small at any length;
the full logits ``[batch, blocks, positions, vocab]`` only when asked (``logits=True``): on the 0.8B
(vocab 248320, 24 blocks) they are 12 GB in float32 for 512 positions.
"""
from __future__ import annotations

import torch

from .errors import InvalidArgument, NotCaptured
from .plots import lens_figure

__all__ = ["LogitLens", "logit_lens", "project_on_vocab"]

CELLS = 1 << 26  # vocabulary entries projected at once (256 MB in float32): the rows of one projection


class LogitLens(dict):
    """The logit lens of one call, as ``ig.logit_lens`` returns it.

    As a dict (what it always was, so old uses keep working): ``{block: (token ids, probabilities)}``,
    each ``[batch, len(positions), top]``, the block's top tokens at each position, largest first. As
    tensors: ``top_ids`` and ``top_probs`` ``[batch, blocks, positions, top]`` (the same numbers), and,
    when the call asked ``logits=True``, ``logits`` ``[batch, blocks, positions, vocab]`` (float32: the
    norm and lm_head of each block's output) and ``probs`` (their softmax over the vocabulary).
    ``positions`` are the positions read (non-negative; every position of a left-padded row, its pads
    too), ``input_ids`` and ``attention_mask`` the call's; ``plot()`` draws the grid. All detached."""

    def __init__(self, top_ids: torch.Tensor, top_probs: torch.Tensor, positions: list[int], input_ids: torch.Tensor,
                 source=None, *, logits: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None):
        super().__init__({block: (top_ids[:, block], top_probs[:, block]) for block in range(top_ids.shape[1])})
        self.top_ids, self.top_probs, self.positions = top_ids, top_probs, positions
        if attention_mask is not None:  # as the call took it: a tensor, or a list of rows
            attention_mask = torch.as_tensor(attention_mask)
        self.input_ids, self.attention_mask, self._logits, self._source = input_ids, attention_mask, logits, source

    @property
    def logits(self) -> torch.Tensor:
        """``[batch, blocks, positions, vocab]``: each block's output through the final norm and lm_head."""
        if self._logits is None:
            raise NotCaptured("this lens holds each cell's top tokens (top_ids, top_probs) only: ask "
                              "logit_lens(..., logits=True) for the full logits [batch, blocks, positions, vocab] "
                              "(positions=[...] keeps them small on a large vocabulary)")
        return self._logits

    @property
    def probs(self) -> torch.Tensor:
        """``logits`` softmaxed over the vocabulary: ``[batch, blocks, positions, vocab]``."""
        return self.logits.softmax(-1)

    def plot(self, tokenizer=None, *, batch: int = 0, tokens=None):
        """A ``qgraph.Figure``: blocks (up) × positions (across), each cell the block's top token there,
        coloured by its probability (a left-padded row's pads are left blank). Tokens are decoded with
        ``tokenizer`` (default: the model's own when its folder holds one, else the ids are shown);
        ``tokens`` labels the positions instead of the input's tokens; ``batch`` picks the prompt."""
        return lens_figure(self, tokenizer, batch, tokens)

    def __repr__(self) -> str:
        batch, blocks, positions, top = self.top_ids.shape
        full = ", logits" if self._logits is not None else ""
        return (f"LogitLens({blocks} blocks x {positions} positions, batch {batch}, top {top}{full}; "
                f".plot() draws it)")


def project_on_vocab(ig, hidden: torch.Tensor) -> torch.Tensor:
    """What ``InstrumentedModel.project_on_vocab`` returns: the model's final norm, then its lm_head."""
    hidden_size = ig.config.get_text_config().hidden_size
    if not isinstance(hidden, torch.Tensor) or hidden.dim() == 0 or hidden.shape[-1] != hidden_size:
        got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise InvalidArgument(f"project_on_vocab takes a residual-stream tensor [..., {hidden_size}] (e.g. "
                              f"out['layers.3.layer_output']), got {got}")
    modules = {ig.family.module_name(path): module for path, module in ig.model.named_modules()}
    norm, head = (modules[path] for path in ig.family.readout)
    return head(norm(hidden))


def lens_positions(positions, seq: int) -> list[int]:
    """``positions`` (``"all"``, an int or a list of ints, negative ones from the end) as non-negative ints."""
    if isinstance(positions, str) and positions == "all":
        return list(range(seq))
    asked = [positions] if isinstance(positions, int) else positions
    if not isinstance(asked, (list, tuple, range)) or not asked or not all(
            isinstance(p, int) and not isinstance(p, bool) and -seq <= p < seq for p in asked):
        raise InvalidArgument(f"logit_lens positions={str(positions)[:60]} are not token positions of a {seq}-token "
                              f"call: give \"all\", an int or a list of ints in [-{seq}, {seq})")
    return [p % seq for p in asked]


def logit_lens(ig, input_ids, attention_mask=None, positions="all", top: int = 5, logits: bool = False) -> LogitLens:
    """What ``InstrumentedModel.logit_lens`` returns (see there), on any instrument with ``project_on_vocab``."""
    vocab = ig.config.get_text_config().vocab_size
    if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= vocab:
        raise InvalidArgument(f"top must be an int in [1, vocab size {vocab}], got {top!r}")
    if not isinstance(logits, bool):
        raise InvalidArgument(f"logits= is True (keep the full logits) or False, got {logits!r}")
    out = ig.variant(["layers.*.layer_output"], logits=False)(input_ids, attention_mask)
    seq = out["layers.0.layer_output"].shape[1]
    positions = lens_positions(positions, seq)
    hidden = torch.stack([out[f"layers.{block}.layer_output"][:, positions] for block in range(ig.blocks)], dim=1)
    ids, probs, full = [], [], []
    with torch.no_grad():  # results, not a graph through the model's norm and head (they are parameters)
        for rows in hidden.flatten(0, 2).split(max(1, CELLS // vocab)):  # a bounded projection at a time
            projected = ig.project_on_vocab(rows).float()
            best = projected.softmax(-1).topk(top, dim=-1)
            ids.append(best.indices)
            probs.append(best.values)
            if logits:
                full.append(projected)
    grid = hidden.shape[:3]
    return LogitLens(torch.cat(ids).reshape(*grid, top), torch.cat(probs).reshape(*grid, top), positions,
                     out.input_ids, ig, logits=torch.cat(full).reshape(*grid, -1) if logits else None,
                     attention_mask=attention_mask)
