"""What the decompositions return: ``LogitAttribution`` (``out.logit_attribution``) and ``ResidualStack``
(``out.residual_stack``), each with its labels, its bias terms, ``top`` and ``plot``."""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import NotCaptured
from ..plots.attribution import decomposition_figure
from ..plots.common import checked_index, decode, tokenizer_of


class Decomposition:
    """What both share: ``labels`` (one per component, in stream order), a score per component, batch row
    and position (``scored``), the bias terms' scores, and the ``positions`` (non-negative) they are at."""

    unit = "score"

    def __init__(self, labels: list[str], scores: Tensor, bias_scores: dict[str, Tensor], positions: list[int],
                 input_ids: Tensor | None, source):
        self.labels, self.positions = labels, positions
        self.input_ids, self.source = input_ids, source
        self._scores, self._bias_scores = scores, bias_scores

    def what(self) -> str:
        """What the scores are, for a title."""
        return self.unit

    def totals(self) -> Tensor:
        """What the scores sum to, ``[batch, positions]``."""
        return self._scores.sum(0) + sum(self._bias_scores.values(), torch.zeros(()))

    def scored(self) -> tuple[Tensor, list[str]]:
        """``(scores [components + bias terms, batch, positions], their labels)``."""
        bias = list(self._bias_scores)
        scores = torch.cat([self._scores, *(self._bias_scores[label][None] for label in bias)])
        return scores, self.labels + bias

    def top(self, k: int = 10, *, batch: int = 0, position: int = -1) -> list[tuple[str, float]]:
        """The ``k`` components (bias terms among them) with the largest scores, by size, at one batch row
        and one of the ``positions`` (an index into them: -1 the last), as ``(label, score)``."""
        scores, labels = self.scored()
        batch = checked_index(batch, scores.shape[1], "batch")
        position = checked_index(position, scores.shape[2], "position")
        column = scores[:, batch, position]
        order = column.abs().argsort(descending=True)[:k].tolist()
        return [(labels[i], float(column[i])) for i in order]

    def plot(self, *, batch: int = 0, rows: int = 30):
        """A ``qgraph.Figure``: one position a bar per component, several a components × positions grid, on
        a diverging scale centred at zero; the ``rows`` components (bias terms among them) with the largest
        scores, in stream order (``qgraph/plots/attribution.py``)."""
        return decomposition_figure(self, batch, rows)

    def _row(self, label: str, rows: Tensor, bias: dict) -> Tensor:
        if label in bias:
            return bias[label]
        if label not in self.labels:
            shown = ", ".join(self.labels[:6]) + (", ..." if len(self.labels) > 6 else "")
            raise NotCaptured(f"no component '{label}': the components are {shown} (.labels), the bias terms "
                              f"{', '.join(bias) or 'none'} (.bias)")
        return rows[self.labels.index(label)]

    def __len__(self) -> int:
        return len(self.labels)


class LogitAttribution(Decomposition):
    """Each component's direct contribution to the logit of ``tokens`` (minus ``against``'s), through the
    final norm with its scale frozen at the call's own: ``attributions [components, batch, positions]``
    with ``labels``, ``bias`` (``{label: [batch, positions]}``: the parts of the stream that are no
    component's, a dictionary's decoder bias and error), and ``total`` (the logit or difference the call
    computed, ``[batch, positions]``): ``attributions.sum(0) + sum(bias.values()) == total``.
    ``attr["layers.3.self_attn.head.2"]`` is one row; ``top(k)`` and ``plot()`` read them."""

    unit = "logit"

    def __init__(self, labels, attributions: Tensor, bias: dict[str, Tensor], total: Tensor, positions, tokens,
                 against, input_ids, source):
        super().__init__(labels, attributions, bias, positions, input_ids, source)
        self.attributions, self.bias, self.total = attributions, bias, total
        self.tokens, self.against = tokens, against  # [batch, positions] ids

    def what(self) -> str:
        tokenizer = tokenizer_of(self.source)

        def named(ids: Tensor) -> str:
            unique = ids.unique()
            return f"'{decode(unique.tolist(), tokenizer)[0]}'" if unique.numel() == 1 else "each position's token"

        against = "" if self.against is None else f" − {named(self.against)}"
        return f"direct logit attribution: {named(self.tokens)}{against}"

    def totals(self) -> Tensor:
        return self.total

    def __getitem__(self, label: str) -> Tensor:
        return self._row(label, self.attributions, self.bias)

    def __repr__(self) -> str:
        return (f"LogitAttribution({len(self.labels)} components, {len(self.bias)} bias terms, batch "
                f"{self.attributions.shape[1]}, positions {self.positions}; .top(k), .plot())")


class ResidualStack(Decomposition):
    """The components whose sum is the residual value ``name``: ``stack [components, batch, positions,
    hidden]`` with ``labels``, ``bias`` (``{label: [batch, positions, hidden]}``), and ``value`` (the
    value itself, ``[batch, positions, hidden]``): ``stack.sum(0) + sum(bias.values()) == value``. Its
    scores (``top``, ``plot``) are each component's projection on the value's direction, which sum to the
    value's norm. ``stack_["embed"]`` is one component's vectors."""

    unit = "projection"

    def __init__(self, name: str, labels, stack: Tensor, bias: dict[str, Tensor], value: Tensor, positions,
                 input_ids, source):
        unit = value / value.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        projections = {label: (vectors * unit).sum(-1) for label, vectors in bias.items()}
        super().__init__(labels, (stack * unit).sum(-1), projections, positions, input_ids, source)
        self.name, self.stack, self.bias, self.value = name, stack, bias, value

    def what(self) -> str:
        return f"{self.name}: each component's projection on its direction"

    def totals(self) -> Tensor:
        return self.value.norm(dim=-1)

    def __getitem__(self, label: str) -> Tensor:
        return self._row(label, self.stack, self.bias)

    def __repr__(self) -> str:
        return (f"ResidualStack({self.name}: {len(self.labels)} components, {len(self.bias)} bias terms, "
                f"{tuple(self.stack.shape[1:])}; .top(k), .plot())")
