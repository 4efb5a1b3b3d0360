"""The logit lens (``ig.logit_lens``): every block's top tokens, and its picture, a blocks × positions grid."""
from __future__ import annotations

import torch

from .errors import InvalidArgument
from .plots import lens_figure

__all__ = ["LogitLens", "logit_lens", "project_on_vocab"]


class LogitLens(dict):
    """``{block: (token ids, probabilities)}``, each ``[batch, len(positions), top]`` and detached, as
    ``ig.logit_lens`` returns it (a dict, so every use of one keeps working), with ``positions`` (as asked,
    non-negative), the call's ``input_ids`` and ``plot``."""

    def __init__(self, tops: dict, positions: list[int], input_ids: torch.Tensor, source=None):
        super().__init__(tops)
        self.positions, self.input_ids, self._source = positions, input_ids, source

    def plot(self, tokenizer=None, *, batch: int = 0, tokens=None):
        """A ``qgraph.Figure``: blocks (up) × positions (across), each cell the block's top token there,
        coloured by its probability. Tokens are decoded with ``tokenizer`` (default: the model's own
        when its folder holds one, else the ids are shown); ``tokens`` labels the positions instead of
        the input's tokens; ``batch`` picks the prompt."""
        return lens_figure(self, tokenizer, batch, tokens)

    def __repr__(self) -> str:
        if not self:
            return "LogitLens({})"
        top = next(iter(self.values()))[0].shape[-1]
        return f"LogitLens({len(self)} blocks, positions {self.positions}, top {top}; .plot() draws it)"


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


def logit_lens(ig, input_ids, attention_mask=None, positions=(-1,), top: int = 5) -> LogitLens:
    """What ``InstrumentedModel.logit_lens`` returns (see there)."""
    positions = [positions] if isinstance(positions, int) else list(positions)
    if not isinstance(top, int) or not 1 <= top <= ig.config.get_text_config().vocab_size:
        raise InvalidArgument(f"top must be an int in [1, vocab size], got {top!r}")
    out = ig.variant(["layers.*.layer_output"], logits=False)(input_ids, attention_mask)
    seq = out["layers.0.layer_output"].shape[1]
    bad = [p for p in positions if not isinstance(p, int) or not -seq <= p < seq]
    if bad or not positions:
        raise InvalidArgument(f"logit_lens positions {bad or positions} are not token positions of a {seq}-token call "
                              f"(give ints in [-{seq}, {seq}))")
    result = {}
    with torch.no_grad():  # results, not a graph through the model's norm and head (they are parameters)
        for block in range(ig.blocks):
            hidden = out[f"layers.{block}.layer_output"][:, list(positions)]
            probs = ig.project_on_vocab(hidden).float().softmax(-1).topk(top, dim=-1)
            result[block] = (probs.indices, probs.values)
    return LogitLens(result, [p % seq for p in positions], out.input_ids, ig)

