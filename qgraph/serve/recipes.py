"""``qgraph.patch`` and ``logit_lens`` on a remote instrument (``attribution_patch`` needs nothing of its
own: a remote call's gradients come from the server).

A remote patch captures the clean values once, then sends one request per location, a ``Replace`` of
that location by its clean value on the corrupt input; they go concurrently, so the server runs them as
a few batched forwards. The metric runs here, on the logits each reply holds.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from ..edits import Replace
from ..sweep import spots_of, stacked

CONCURRENT = 8  # requests in flight at once


def patch(instrumented, clean: dict, corrupt: dict, names: list[str], metric, positions=None, heads=None) -> dict:
    """What ``qgraph.patch`` returns, each location run on the server."""
    with torch.no_grad():
        clean_values = instrumented.variant(names)(**clean).values
    results = {}
    for name in names:
        entry, value = instrumented.catalogue[name], clean_values[name]
        axes, chosen, spots = spots_of(list(entry.shape), value.shape, positions, heads, name, entry.layout)
        patcher = instrumented.variant(())

        def one(spot):
            position, head = spot
            index = [slice(None)] * value.dim()
            region = {}
            if position is not None:
                index[axes["positions"]], region["positions"] = [position], [position]
            if head is not None:
                index[axes["heads"]], region["heads"] = [head], [head]
            edit = Replace(value[tuple(index)].contiguous(), **region)
            with torch.no_grad():
                return metric(patcher(**corrupt, edits={name: edit}).logits)

        with ThreadPoolExecutor(CONCURRENT) as pool:
            results[name] = stacked(list(pool.map(one, spots)), chosen, positions, heads, name)
    return results


def logit_lens(instrumented, input_ids, attention_mask=None, positions=(-1,), top: int = 5):
    """What ``ig.logit_lens`` returns, the projection on the vocabulary run on the server."""
    from ..lens import LogitLens
    positions = [positions] if isinstance(positions, int) else list(positions)
    call, tensors = instrumented._call(input_ids, attention_mask, None)
    call = {"lens": {"positions": positions, "top": top}}
    reply, got = instrumented.server.run(call, tensors)
    tops = {block: (got[f"lens.{block}.ids"], got[f"lens.{block}.probabilities"]) for block in range(reply["blocks"])}
    return LogitLens(tops, reply["positions"], tensors["input_ids"])
