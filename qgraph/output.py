"""What an instrumented call returns: ``Output``, the logits and the captured values by name."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import InvalidState, NotCaptured
from .passes import views
from .values.names import canonical


@dataclass
class Output:
    """What an instrumented call returns: the model's logits and the captured values by name.

    ``out[name]`` takes the spellings ``values=`` takes (``layers[-1].layer_output``).
    """

    logits: torch.Tensor | None
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    blocks: int = 0  # the model's block count, to read negative block indices
    # for each value asked with {"grad": True}: the tensor its readers read, and the view it is served through
    watched: dict[str, tuple[torch.Tensor, tuple]] = field(default_factory=dict, repr=False)

    def __getitem__(self, name: str) -> torch.Tensor:
        key = canonical(name, self.blocks)
        if key not in self.values:
            raise NotCaptured(f"'{name}' was not captured; captured: {', '.join(self.values) or 'nothing'}")
        return self.values[key]

    def grad(self, name: str) -> torch.Tensor:
        """The gradient of the loss you called ``backward()`` on with respect to a value asked with
        ``values={name: {"grad": True}}``, in the value's layout (as ``x.grad`` of the tensor the
        rest of the model read: an edited value's gradient is the edited tensor's)."""
        key = self._watched(name)
        tensor, view = self.watched[key]
        if not tensor.requires_grad:
            raise InvalidState(f"'{key}' has no gradient: the call ran with gradients off (torch.no_grad or "
                               f"inference_mode); call the instrumented model outside it")
        if tensor.grad is None:
            raise InvalidState(f"no gradient has reached '{key}' yet: call backward() on a loss computed from this "
                               f"call's outputs first (a loss that does not depend on '{key}' gives it none)")
        return views.apply(tensor.grad, view)

    def gradients(self, loss: torch.Tensor, names=None) -> dict[str, torch.Tensor]:
        """``{name: d loss / d value}`` for the ``grad`` values (or ``names`` of them), computed with
        ``torch.autograd.grad``: no ``.grad`` of the model's parameters is touched. A value the loss does
        not depend on gets zeros."""
        keys = [self._watched(name) for name in (names if names is not None else self.watched)]
        tensors = [self.watched[key][0] for key in keys]
        grads = torch.autograd.grad(loss, tensors, allow_unused=True, materialize_grads=True)
        return {key: views.apply(g, self.watched[key][1]) for key, g in zip(keys, grads)}

    def _watched(self, name: str) -> str:
        key = canonical(name, self.blocks)
        if key not in self.watched:
            asked = ", ".join(self.watched) or "none"
            raise NotCaptured(f"'{name}' was not asked with gradients: instrument with values={{'{name}': {{'grad': True}}}} "
                              f"(values with gradients: {asked})")
        return key

    def __contains__(self, name: str) -> bool:
        return canonical(name, self.blocks) in self.values
