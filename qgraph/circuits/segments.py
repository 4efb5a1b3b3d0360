"""The replacement model's forward a segment of the prompt at a time, so that each target's backward
runs over the positions up to its own and no further.

A target at position p (a feature's pre-activation there, or a logit at the last position) depends on
positions 0..p only: attention is causal and the DeltaNet's recurrence runs forward in time. A
backward through one forward of the whole prompt still runs every op over every position (the
gradients after p are zeros, computed). So a prompt longer than ``SEGMENT`` tokens runs as a cached
step per segment (the program generation's prompt pass runs, ``passes.decode.OpenCache``): each
segment reads what the ones before it left (the attention's keys and values, the DeltaNet's state
and conv context) and hands on its own, with their gradients. The forward's graph is then a chain of
segment graphs, and a backward from a target in segment k runs through segments 0..k and never
reaches a later one (autograd runs only what leads to the outputs asked). Every value is the
one-pass forward's within float32 rounding (the same arithmetic, split where the kernels split it).

``SEGMENT`` is the DeltaNet kernel's chunk (64 tokens): the chunked delta rule pads each call to a
multiple of it, so shorter segments would pay for padded chunks in every forward and backward, and
longer ones would end fewer backwards early. A prompt of ``SEGMENT`` tokens or fewer runs in one pass
of the program without a cache, as before.

What it costs: the keys and values each attention segment concatenates (the past's and its own) and
the state and conv context each DeltaNet segment hands on stay saved for the backward; a few MiB at
512 tokens on the 0.8B shape (``benchmarks/bench_targets.py`` measures it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InternalError
from ..decode_cache import causal_mask, empty_cache, next_cache
from ..kernels.grad import keep_recomputation

SEGMENT = 64  # tokens a segment of the forward holds (the DeltaNet kernel's chunk)


@dataclass
class Segment:
    """One segment of the forward: its positions ``start..end``, its captured values (with their
    graphs) and the leaves where the sources' gradients are read (``{inject name: [1, end - start,
    width]}``)."""
    start: int
    end: int
    captured: dict
    leaves: dict


def bounds(seq: int) -> list[tuple[int, int]]:
    """The segments of a ``seq``-token prompt: ``(start, end)`` of each, ``SEGMENT`` tokens but the last."""
    return [(start, min(seq, start + SEGMENT)) for start in range(0, seq, SEGMENT)]


def cached(seq: int) -> bool:
    """Whether a ``seq``-token prompt runs in segments (a cached program) or in one pass."""
    return len(bounds(seq)) > 1


def programs(model, values: list[str], transcoders, seq: int) -> tuple:
    """The replacement model's program tapping ``values`` (``transcoders``: a ``TranscoderSet``), and, for a
    ``seq``-token prompt run in segments, its cached step (else None)."""
    from ..export import export_model  # lazy: keeps transformers out until this is used
    from ..families import family_for  # lazy: keeps transformers out until this is used
    from ..passes.decode import carried  # lazy: keeps transformers out until this is used
    from ..program import Program  # lazy: keeps sympy, transformers out until this is used

    exported = export_model(model, images=False)
    # the parameters without their gradients: a backward reaches the sources only, and keeps nothing for weights
    weights = {name: parameter.detach() for name, parameter in model.named_parameters()}

    def build(logits: bool, **cache):
        return Program(model, exported, weights=weights).build(values, {}, logits, replacement=transcoders.spliced,
                                                               **cache)
    # the segments' logits are never read (a logit target's direction lies on the final norm's output)
    stepped = build(False, cache="prompt", make=carried(family_for(model), model.config)) if cached(seq) else None
    return build(True), stepped


def forward(model, ids: torch.Tensor, plain, stepped, names: list[str], width: int, counter) -> tuple:
    """The prompt ``ids`` ``[seq]`` through the replacement model: ``(logits, captured, segments)``, the
    logits the last position's ``[1, 1, vocab]``. The logits and the captured values (the graph's nodes
    and what its sources add) are always the one-pass forward's (``plain``), so the graph is the one it
    was without segments: a segmented forward's values differ in float32 rounding, enough to swap a TopK
    feature at a near-tie. The segments hold the graphs the backwards run through: the one pass itself,
    or, where ``stepped`` (the cached step), the prompt run in segments after a one-pass forward that
    keeps nothing for a backward. ``counter`` (``memory.SavedBytes``) sees what autograd saves for the
    backwards."""
    seq = ids.shape[0]
    if stepped is not None:
        with torch.no_grad():
            logits, (whole,) = run_segments(plain, ids, [(0, seq)], names, width, model)
        logits, values = _last(logits), whole.captured  # the whole prompt's logits are not kept
    with torch.enable_grad(), keep_recomputation(), torch.autograd.graph.saved_tensors_hooks(counter.pack,
                                                                                              counter.unpack):
        # every batch of targets reuses one recomputed kernel
        last, segments = run_segments(stepped or plain, ids, bounds(seq) if stepped else [(0, seq)], names, width,
                                      model)
    if stepped is None:
        logits, values = _last(last), segments[0].captured
    return logits, values, segments


def _last(logits: torch.Tensor | None) -> torch.Tensor:
    """The last position's logits, a copy (the whole prompt's are not kept)."""
    if logits is None:
        raise InternalError("the replacement model's one-pass program returns its logits")
    return logits[:, -1:].detach().clone()


def run_segments(program, ids: torch.Tensor, pieces: list[tuple[int, int]], names: list[str], width: int,
                 model) -> tuple[torch.Tensor | None, list[Segment]]:
    """Run ``program`` (built with ``cache="prompt"`` where ``pieces`` are more than one) on the prompt ``ids``
    ``[seq]``, a segment (``pieces``: their bounds) at a time, with zeros (leaves that take gradients) at the
    program inputs ``names``: the last segment's logits (None without) and every segment. Gradients flow
    between the segments through the cache."""
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    ids = ids.to(device)
    segments, cache = [], None
    if len(pieces) > 1:
        cache = empty_cache(program.family, model.config, 1, parameter)
    for start, end in pieces:
        leaves = {name: torch.zeros(1, end - start, width, dtype=dtype, device=device, requires_grad=True)
                  for name in names}
        inputs = {"input_ids": ids[None, start:end],
                  "attention_mask": torch.ones(1, end - start, dtype=torch.long, device=device), **leaves}
        if cache is not None:
            seen = torch.ones(1, end, dtype=torch.long, device=device)
            first = 0 if program.family.rotary_reads_past else start  # the rotary reads the new positions or all
            inputs.update(positions=torch.arange(first, end, device=device)[None],
                          causal_mask=causal_mask(seen, end - start), **cache)
        logits, captured = program.run(inputs, eager=True)
        if cache is not None:
            cache = next_cache(program.family.memories(model.config), captured)
        segments.append(Segment(start, end, captured, leaves))
    return logits, segments
