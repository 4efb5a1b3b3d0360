"""Read-only values computed after a run from captured ones (the ``Derived`` rules' ``how``)."""
from __future__ import annotations

import torch


def last_position_softmax(logits, *, inputs, config):
    """The next-token distribution at the last position, in float32."""
    return torch.softmax(logits[:, -1].float(), dim=-1)


def size(input_ids, *, inputs, config):
    """(batch, seq) of the call."""
    return torch.Size(input_ids.shape)


def image_token_mask(input_ids, *, inputs, config):
    """Which positions hold image tokens."""
    return input_ids == config.image_token_id


def per_image_scores(queries, keys, *, inputs, config):
    """Each image's scaled scores ``[heads, patches_j, patches_j]``, split at the call's ``cu_seqlens``."""
    bounds = inputs["image_cu_seqlens"].tolist()
    scale = queries.shape[-1] ** -0.5
    return [queries[0, :, a:b] @ keys[0, :, a:b].transpose(-1, -2) * scale for a, b in zip(bounds[:-1], bounds[1:])]


def per_image_probabilities(queries, keys, *, inputs, config):
    """Each image's attention pattern (the softmax of its scores)."""
    return [scores.softmax(-1) for scores in per_image_scores(queries, keys, inputs=inputs, config=config)]
