"""Read-only values computed after a run from captured ones (the ``Derived`` rules' ``how``).

Each function is registered in ``DERIVATIONS`` under its own name (``@derivation``): a ``Derived``
rule, and a saved program's JSON, name it; ``fill`` computes a program's derived values.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..errors import InvalidArgument

DERIVATIONS: dict[str, Callable] = {}  # name -> function(*sources, inputs=, config=) -> value


def derivation(function: Callable) -> Callable:
    """Register ``function(*sources, inputs, config)`` under its name (the name a ``Derived`` rule's
    ``how`` and a saved program store)."""
    DERIVATIONS[function.__name__] = function
    return function


def fill(captured: dict, derived: Mapping[str, tuple[str, Sequence[str]]], inputs: dict, config) -> None:
    """Compute each derived value ``{name: (how, sources)}`` into ``captured`` from its sources there;
    one whose sources were not all captured (absent or None) is skipped."""
    for name, (how, sources) in derived.items():
        function = DERIVATIONS.get(how)
        if function is None:
            raise InvalidArgument(f"{name!r} is derived by {how!r}, which is no registered derivation; the registered "
                                  f"ones are {', '.join(sorted(DERIVATIONS))} (@derivation in qgraph.values.derive)")
        if all(captured.get(source) is not None for source in sources):
            captured[name] = function(*(captured[source] for source in sources), inputs=inputs, config=config)


@derivation
def last_position_softmax(logits, *, inputs, config):
    """The next-token distribution after each row's last real token, in float32: the last position
    the attention mask keeps (with right padding, not the pads after it; the last position of a row
    the mask keeps nowhere)."""
    batch, seq = logits.shape[:2]
    last = torch.full((batch,), seq - 1, device=logits.device)
    mask = inputs.get("attention_mask")
    if mask is not None:
        kept = mask[:, -seq:].to(logits.device).bool()  # a decoding step's mask ends with its new tokens
        positions = torch.arange(seq, device=logits.device)
        last = torch.where(kept.any(-1), (kept * positions).amax(-1), last)
    return torch.softmax(logits[torch.arange(batch, device=logits.device), last].float(), dim=-1)


@derivation
def size(input_ids, *, inputs, config):
    """(batch, seq) of the call."""
    return torch.Size(input_ids.shape)


@derivation
def image_token_mask(input_ids, *, inputs, config):
    """Which positions hold image tokens."""
    return input_ids == config.image_token_id


@derivation
def per_image_scores(queries, keys, *, inputs, config):
    """Each image's scaled scores ``[heads, patches_j, patches_j]``, split at the call's ``cu_seqlens``."""
    bounds = inputs["image_cu_seqlens"].tolist()
    scale = queries.shape[-1] ** -0.5
    return [queries[0, :, a:b] @ keys[0, :, a:b].transpose(-1, -2) * scale for a, b in zip(bounds[:-1], bounds[1:])]


@derivation
def per_image_probabilities(queries, keys, *, inputs, config):
    """Each image's attention pattern (the softmax of its scores)."""
    return [scores.softmax(-1) for scores in per_image_scores(queries, keys, inputs=inputs, config=config)]
