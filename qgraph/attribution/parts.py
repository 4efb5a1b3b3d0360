"""The pieces a residual stream is a sum of, each in the form that keeps its arithmetic cheap.

A piece holds one or more labelled components and gives them two ways: ``vectors()``, each component's
vectors ``[components, batch, positions, hidden]`` (what ``residual_stack`` returns), and
``project(direction)``, each component's dot product with a ``[batch, positions, hidden]`` direction
``[components, batch, positions]`` (what ``logit_attribution`` returns), computed without building the
vectors where that is cheaper (a head's output through its slice of the output projection, a feature
times its decoder row). ``total()`` is the sum of the vectors. Everything is float32 and detached.

- ``Whole``: one component given as its vectors (the embedding, a block's MLP output).
- ``Linear``: components each a coefficient vector times its own matrix: ``coefficients [batch,
  positions, n, r]`` through ``matrices [n, r, hidden]`` (the heads of an output projection: r the head
  dim; dictionary features: r = 1, the matrix a decoder row).
- ``Experts``: a mixture-of-experts block's routed experts, each the sum over the tokens routed to it of
  its router weight times its down projection of its neurons (computed expert by expert, as the block's
  own eager loop does, only for the tokens routed there).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Whole:
    """One component, given as its vectors ``[batch, positions, hidden]``."""

    label: str
    vector: Tensor

    @property
    def labels(self) -> list[str]:
        return [self.label]

    def total(self) -> Tensor:
        return self.vector

    def vectors(self) -> Tensor:
        return self.vector[None]

    def project(self, direction: Tensor) -> Tensor:
        return (self.vector * direction).sum(-1)[None]


@dataclass
class Linear:
    """Components ``k``, each ``coefficients[..., k, :] @ matrices[k]`` (see the module's docstring)."""

    labels: list[str]
    coefficients: Tensor  # [batch, positions, n, r]
    matrices: Tensor  # [n, r, hidden]
    # the label of the components as one where they are a dictionary's features, which ``residual_stack``
    # keeps whole (their vectors would be d_sae per token); "" for heads
    whole: str = ""

    def total(self) -> Tensor:
        return torch.einsum("bpnr,nrh->bph", self.coefficients, self.matrices)

    def vectors(self) -> Tensor:
        return torch.einsum("bpnr,nrh->nbph", self.coefficients, self.matrices)

    def project(self, direction: Tensor) -> Tensor:
        # each matrix read along the direction first: [batch, positions, n, r], then the coefficients' dot
        along = torch.einsum("nrh,bph->bpnr", self.matrices, direction)
        return (self.coefficients * along).sum(-1).permute(2, 0, 1)


@dataclass
class Experts:
    """A mixture-of-experts block's routed experts (see the module's docstring): ``neurons [batch, positions,
    top_k, intermediate]`` (what each routed expert's down projection reads), ``indices`` and ``weights``
    ``[batch, positions, top_k]`` (which expert, with what router weight), ``down [experts, hidden,
    intermediate]`` (in its own dtype: each expert's is cast when used)."""

    labels: list[str]
    neurons: Tensor
    indices: Tensor
    weights: Tensor
    down: Tensor

    def _outputs(self):
        """Each routed expert: ``(expert, where [batch, positions, top_k] it was chosen, its weighted
        outputs [routed tokens, hidden])``."""
        for expert in self.indices.unique().tolist():
            chosen = self.indices == expert
            down = self.down[expert].float()  # one expert's at a time: a model's experts are large
            yield expert, chosen, (self.neurons[chosen] @ down.T) * self.weights[chosen][:, None]

    def _rows(self, chosen: Tensor) -> tuple[Tensor, ...]:
        """The (batch, position) of each routed token, in ``chosen``'s order."""
        batch, position, _ = chosen.nonzero(as_tuple=True)
        return batch, position

    def total(self) -> Tensor:
        return self.vectors().sum(0)

    def vectors(self) -> Tensor:
        out = self.neurons.new_zeros(len(self.labels), *self.indices.shape[:2], self.down.shape[1])
        for expert, chosen, outputs in self._outputs():
            out[expert][self._rows(chosen)] = outputs  # a token routes to an expert once: no two rows meet
        return out

    def project(self, direction: Tensor) -> Tensor:
        out = self.neurons.new_zeros(len(self.labels), *self.indices.shape[:2])
        for expert, chosen, outputs in self._outputs():
            rows = self._rows(chosen)
            out[expert][rows] = (outputs * direction[rows]).sum(-1)
        return out
