"""The memory a cached decoding step reads and hands on (``passes.decode.OpenCache`` opens it in a program):
each piece the family declares (``Family.memories``: an attention block's keys and values, a DeltaNet's state
and conv context, qwen4_exp's indexer keys and PLE contexts), and the causal mask of a step's new tokens over
the tokens so far. ``qgraph.generate`` and attribution's segments (``circuits.segments``) both run steps."""
from __future__ import annotations

import torch


def empty_cache(family, config, batch: int, parameter: torch.Tensor) -> dict[str, torch.Tensor]:
    """The memory before a cached program's first step (``passes.decode.OpenCache``): no past keys and
    values, zero states and contexts, in ``parameter``'s dtype (the states in float32); token ids filled
    with their piece's id (``Memory.fill_id``); on ``parameter``'s device."""
    cache = {}
    for host, piece in family.memories(config):
        size = (batch, *(0 if dim == "past" else family.dim(config, dim) for dim in piece.dims))
        dtype = torch.long if piece.fill_id else torch.float32 if piece.float32 else parameter.dtype
        cache[f"{host}.{piece.name}"] = torch.full(size, piece.fill_id(config) if piece.fill_id else 0, dtype=dtype,
                                                   device=parameter.device)
    return cache


def next_cache(memory, captured: dict) -> dict[str, torch.Tensor]:
    """The memory the next step reads, popped from a step's captured tensors (``memory``: the family's
    ``memories``)."""
    return {f"{host}.{piece.name}": captured.pop(f"{host}.cache_{piece.name}") for host, piece in memory}


def causal_mask(full_mask: torch.Tensor, new: int) -> torch.Tensor:
    """``[batch, 1, new, past + new]``: key j is seen by new token i when it is not padding and
    ``j <= past + i``."""
    length = full_mask.shape[1]
    past = length - new
    keys = torch.arange(length, device=full_mask.device)
    queries = torch.arange(new, device=full_mask.device) + past
    causal = keys[None, :] <= queries[:, None]
    return (causal[None, None] & full_mask.bool()[:, None, None, :])
