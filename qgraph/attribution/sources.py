"""Where a decomposition's inputs come from: the values (the call's own, or a rerun of it) and the weights
(the output projections, the experts' down projections, the final norm and the unembedding) of the door
the ``Output`` came through.

- a local instrument (``qgraph.instrument``) reads its model's parameters, and its SAEs and transcoders;
- a loaded program (``qgraph.load``) reads the weights it runs on, by their export targets; it has no
  dictionary objects, so a program saved with SAEs or transcoders is refused by name;
- a remote instrument holds no weights: what reads one is refused by name, with where to run it instead
  (a residual stack per component or block reads none, and runs on the server's values).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import InvalidState, NotSupported, UnknownValue


class Weights:
    """The weights of ``source`` by their spec names (``layers.3.self_attn.o_proj.weight``, ``norm.weight``,
    ``lm_head.weight``), detached: float32, or in their own dtype with ``rows`` (the rows to take of a large
    one, the unembedding's of the tokens asked; ``rows=...`` all of them), the reader casting them. Read
    when asked: a door without weights refuses then, so what needs none (a residual stack per component)
    runs on it. ``saes`` are its SAEs (``{value: (sae, splice)}``), ``transcoders`` its transcoders
    (``{block: (transcoder, splice)}``)."""

    def __init__(self, source):
        model = getattr(source, "model", None)
        targets: dict[str, Callable[[], Tensor]] = {}
        if isinstance(model, torch.nn.Module):  # an instrumented model: its parameters, read at call time
            targets = {name: _giving(p) for name, p in model.named_parameters(remove_duplicate=False)}
        elif callable(getattr(source, "weights", None)):  # a loaded program: the weights it runs on
            targets = source.weights()
        self._held = bool(targets)
        self._weights: dict[str, Callable[[], Tensor]] = {}
        for target, read in targets.items():
            module, _, attribute = target.rpartition(".")
            self._weights[f"{source.family.module_name(module)}.{attribute}".lstrip(".")] = read
        self.saes: dict = dict(getattr(source, "saes", None) or {})
        self.transcoders: dict = dict(getattr(source, "transcoders", None) or {})
        self._where = type(source).__name__

    def has(self, name: str) -> bool:
        return name in self._weights

    def __call__(self, name: str, rows=None) -> Tensor:
        if not self._held:
            raise NotSupported(f"a {self._where} holds no weights, and this decomposition reads '{name}': run it "
                               f"where the weights are (on the server's machine with qgraph.instrument(model), or "
                               f"qgraph.load(path) of a program saved with weights)")
        if name not in self._weights:
            raise NotSupported(f"this {self._where} does not hold the weight '{name}' (a saved program holds the "
                               f"weights its graph reads: one saved with logits=False has no unembedding): decompose "
                               f"with qgraph.instrument(model), or save the program with logits")
        tensor = self._weights[name]()
        if tensor.is_meta:
            raise InvalidState(f"the weight '{name}' is on the meta device: decompose an instrument of a model whose "
                               f"weights are loaded")
        return tensor.detach().float() if rows is None else tensor.detach()[rows]


def values_for(out, names: list[str]) -> tuple[dict[str, Tensor], Tensor | None]:
    """``({name: tensor}, logits)`` of the call ``out`` came from: its own values where it captured every one
    of ``names`` (its edits in force, whatever they were), else a rerun of the call (its tokens, attention
    mask and edits) through a variant of its instrument that reads them. The rerun must give back the call's
    logits: a call it cannot repeat (with images, or edits that change from call to call) is refused, with
    the values to capture instead."""
    if all(name in out.values for name in names):
        return {name: out.values[name] for name in names}, out.logits
    source = out.source
    if source is None or not callable(getattr(source, "variant", None)) or out.input_ids is None:
        raise InvalidState(f"this Output does not say which instrument made it, so the values it lacks cannot be "
                           f"computed: capture them in the call, values={names}")
    try:
        variant = source.variant(names)
    except (NotSupported, UnknownValue) as error:  # a saved program knows only the values it was saved with
        raise NotSupported(f"the decomposition reads {names}, which {source!r} cannot read ({error}): save the "
                           f"program with them among its values") from None
    with torch.no_grad():
        again = variant(out.input_ids, out.attention_mask, edits=out.edits)
    if out.logits is not None and again.logits is not None and not _same(out.logits, again.logits):
        raise InvalidState(f"rerunning the call to read the values it lacks gave other logits (a call with images, "
                           f"or edits that differ from call to call, do not repeat): capture the values in the call "
                           f"itself, values={names}")
    return again.values, again.logits


def _giving(tensor: Tensor) -> Callable[[], Tensor]:
    return lambda: tensor


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether two runs' logits agree, up to what their dtype rounds (another program may sum in another order)."""
    if a.shape != b.shape:
        return False
    tolerance = max(1e-4, 16 * torch.finfo(a.dtype).eps) * float(a.detach().abs().max().clamp_min(1.0))
    return float((a.detach().float() - b.detach().float().to(a.device)).abs().max()) <= tolerance
