"""Feature interventions, as circuit-tracer's ``ReplacementModel.feature_intervention`` and
``feature_intervention_generate`` have them (``replacement_model_transformerlens.py``, 0.5.0).

An intervention ``(layer, position, feature, value)`` sets a transcoder feature to ``value``; the
MLP output of the block (of every block its decoders write, for a cross-layer transcoder) moves by
``(value - activation) * W_dec[feature]``, circuit-tracer's delta hook. Three modes:

- live (the default): the model runs with the transcoders spliced (``instrument(transcoders=...)``,
  ``splice="error"``) and the features edited (``layers.{l}.transcoder.features``): the MLP output is
  ``m + decode(edited) - decode(original)``, ``m`` the model's own MLP, and every later block responds;
- ``freeze_attention=True``: the same, with what mixes positions held at the clean run's values
  (``passes.replacement`` with ``replacement=ATTENTION``): sdpa's queries and keys (its pattern) and
  the delta-rule kernels' queries, keys, decays and betas (a DeltaNet's "pattern"); norms and MLPs live;
- ``constrained_layers`` = every block: direct effects. The replacement model (``passes.replacement``)
  recorded on the clean run and replayed: attention, every norm's scale, every gate, every MLP output
  held; the deltas added at the MLP outputs (``inject_{block}``). Only the linear paths respond (the
  residual stream, the attention and DeltaNet value paths, a transcoder's skip), so each feature's
  pre-activation and each logit minus the mean logit move by ``delta * edge`` of the attribution graph.

Where qgraph differs from circuit-tracer, and why:

- ``freeze_attention`` defaults to False (circuit-tracer's to True): the plain call is then the live
  model with the edit, as every other qgraph edit is;
- ``activations`` are every spliced block's features as this run computes them from its input, with the
  intervened entries showing the value set (circuit-tracer returns the encoder's output there, the value
  before it was set); no position is zeroed (circuit-tracer zeroes its BOS position): ids are used as given;
- direct effects hold every coefficient the attribution graph freezes (also the attention output gate,
  the gated norm's ``silu(z)`` and the DeltaNet conv's SiLU gate, which circuit-tracer's models lack), so
  that the identity with the graph's edges is exact; a strict subset of ``constrained_layers`` is refused.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..errors import InvalidArgument, InvalidType, NotSupported
from ..inputs import input_embedding
from ..compat import attn_implementation
from ..inputs import prepare
from ..kernels.ops import DELTA_RULE_OPS
from ..passes.edit import applying
from ..saes.clt import CrossLayerTranscoder
from ..saes.transcoder import Transcoder


@dataclass(repr=False)
class Intervened:
    """``logits`` ``[1, seq, vocab]``; ``activations`` ``[len(blocks), seq, d_transcoder]``: the features
    of each spliced block (``blocks``, in order: with every block spliced, row i is block i)."""

    logits: torch.Tensor
    activations: torch.Tensor
    blocks: tuple[int, ...]

    def __repr__(self) -> str:
        return f"Intervened(logits {list(self.logits.shape)}, activations {list(self.activations.shape)})"


@dataclass(repr=False)
class Generated:
    """``tokens``: the new token ids ``[new]``; ``logits`` ``[new, vocab]``: those that chose each new
    token (the prompt's last position, then each one-token pass); ``activations`` ``[len(blocks), seq +
    new - 1, d_transcoder]``: the features at every position run through to choose them."""

    tokens: torch.Tensor
    logits: torch.Tensor
    activations: torch.Tensor
    blocks: tuple[int, ...]

    def __repr__(self) -> str:
        return f"Generated({len(self.tokens)} new tokens, activations {list(self.activations.shape)})"


@torch.no_grad()
def feature_intervention(model_or_ig, input_ids, transcoders, interventions, constrained_layers=None,
                         freeze_attention: bool = False, apply_activation_function: bool = True) -> Intervened:
    """Run ``input_ids`` (one prompt, ``[seq]`` or ``[1, seq]``) with each ``(layer, position, feature,
    value)`` of ``interventions`` set (``position`` an int, or a slice of positions). ``transcoders``:
    ``{block: qgraph.Transcoder}`` (any blocks), a ``qgraph.CrossLayerTranscoder`` or a folder of either.
    Modes (the module doc): live; ``freeze_attention=True``; ``constrained_layers=range(n_blocks)``, the
    direct effects. ``apply_activation_function=False`` returns pre-activations instead of features."""
    model, ids, spliced, wanted, direct = _setup(model_or_ig, input_ids, transcoders, interventions,
                                                 constrained_layers, freeze_attention, apply_activation_function)
    if direct:
        return _direct(model, ids, spliced, wanted, apply_activation_function)
    ig = spliced.instrument(model, apply_activation_function)
    edits = {name: _Set(entries, len(ids)) for name, entries in _by_block(wanted).items()}
    if freeze_attention and edits:
        logits, captured = _frozen_attention(ig, ids, edits)
    else:
        out = ig(ids[None], edits=edits)
        logits, captured = out.logits, {name: out[name] for name in ig.values}
    rows = spliced.activations(captured, apply_activation_function, wanted, len(ids))
    return Intervened(logits, rows, tuple(spliced.blocks))


@torch.no_grad()
def feature_intervention_generate(model_or_ig, input_ids, transcoders, interventions, max_new_tokens: int = 20,
                                  constrained_layers=None, freeze_attention: bool = False,
                                  apply_activation_function: bool = True, **kwargs) -> Generated:
    """Generate from ``input_ids`` (greedily; ``kwargs`` go to ``InstrumentedModel.generate``: ``do_sample``,
    ``temperature``, ...) with the interventions set on the prompt's positions and, for an open-ended
    position ``slice(p, None)``, on every new token too (circuit-tracer's). Live mode only: circuit-tracer
    applies ``freeze_attention`` and ``constrained_layers`` to the first token alone; here they are refused
    (use ``feature_intervention`` for that token)."""
    if constrained_layers is not None or freeze_attention:
        raise NotSupported("feature_intervention_generate runs the live model only (circuit-tracer freezes the "
                           "first token alone): drop constrained_layers and freeze_attention, or call "
                           "feature_intervention for the first token")
    taken = sorted({"edits", "values", "steps"} & set(kwargs))
    if taken:
        raise InvalidArgument(f"feature_intervention_generate sets {', '.join(taken)} itself: leave them out")
    model, ids, spliced, wanted, _ = _setup(model_or_ig, input_ids, transcoders, interventions, None, False,
                                            apply_activation_function, open_ended=True)
    ig = spliced.instrument(model, apply_activation_function)
    edits = {name: _Set(entries, len(ids), generating=True) for name, entries in _by_block(wanted).items()}
    out = ig.generate(ids[None], max_new_tokens=max_new_tokens, edits=edits, values=ig.values, **kwargs)
    new = out.sequences.shape[1] - len(ids)
    passes = out.steps[:new]  # the last pass (over the last new token) chose nothing
    captured = {name: torch.cat([step[name] for step in passes], dim=1) for name in ig.values}
    prompt = [(b, p, f, v) for b, p, f, v in wanted if p is not None]  # open-ended ones: also the new tokens
    opened = [(b, p, f, v) for b, p, f, v in wanted if p is None]
    rows = spliced.activations(captured, apply_activation_function, prompt, len(ids), opened)
    return Generated(out.sequences[0, len(ids):], torch.cat(out.logits[:new]), rows, tuple(spliced.blocks))


# -- the arguments -----------------------------------------------------------------------------------
def _setup(model_or_ig, input_ids, transcoders, interventions, constrained_layers, freeze_attention,
           apply_activation_function, open_ended: bool = False):
    """Every argument checked, before any forward: (model, ids, spliced, [(block, position or None for an
    open-ended one, feature, value)], whether direct effects)."""
    from ..families import family_for  # lazy: keeps transformers out until this is used
    from ..instrument import InstrumentedModel  # lazy: keeps safetensors, sympy, transformers out until this is used
    # lazy: qgraph.circuits.attribute imports this module's package at import time (a cycle)
    from .attribute import checked_prompt

    model = model_or_ig.model if isinstance(model_or_ig, InstrumentedModel) else model_or_ig
    # on the embedding's device, as attribution_graph moves them
    ids = checked_prompt(input_ids, model).to(input_embedding(model).weight.device)
    blocks = len(family_for(model).block_mixers(model.config))
    flags = {"freeze_attention": freeze_attention, "apply_activation_function": apply_activation_function}
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise InvalidType(f"{name} takes True or False, not {flag!r}")
    spliced = _Spliced(transcoders, blocks, model)
    wanted = _interventions(interventions, spliced, len(ids), open_ended)
    direct = _constrained(constrained_layers, blocks)
    if direct and spliced.blocks != list(range(blocks)):
        missing = sorted(set(range(blocks)) - set(spliced.blocks))
        raise InvalidArgument(f"constrained_layers=range({blocks}) runs the replacement model, which needs a "
                              f"transcoder at every block; blocks {missing} have none")
    return model, ids, spliced, wanted, direct


def _interventions(interventions, spliced, seq: int, open_ended: bool) -> list[tuple]:
    """``[(block, position, feature, value)]``, one per position (a slice's expanded; an open-ended one's
    ``slice(p, None)`` in generation also as ``(block, None, feature, value)``), the last of equals kept."""
    if isinstance(interventions, (str, bytes, torch.Tensor)) or not isinstance(interventions, (list, tuple)):
        raise InvalidType(f"interventions takes a list of (layer, position, feature, value) tuples, not "
                          f"{type(interventions).__name__}")
    chosen: dict[tuple, float] = {}
    for i, item in enumerate(interventions):
        where = f"interventions[{i}]"
        if not isinstance(item, (tuple, list)) or len(item) != 4:
            raise InvalidArgument(f"{where} is {item!r}: give a tuple (layer, position, feature, value)")
        layer, position, feature, value = item
        if not _is_int(layer) or layer not in spliced.blocks:
            raise InvalidArgument(f"{where}: layer {layer!r} has no transcoder spliced: give one of the blocks "
                                  f"{spliced.blocks} (or splice a transcoder there)")
        if not _is_int(feature) or not 0 <= feature < spliced.width:
            raise InvalidArgument(f"{where}: feature {feature!r}: the transcoders have features 0 to "
                                  f"{spliced.width - 1}")
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            value = float(value)
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
            raise InvalidArgument(f"{where}: value {value!r}: give the feature's new activation, a finite number")
        for at in _positions(position, seq, where, open_ended):
            chosen[(int(layer), at, int(feature))] = float(value)
    return [(*key, value) for key, value in chosen.items()]


def _positions(position, seq: int, where: str, open_ended: bool) -> list:
    if _is_int(position):
        if not -seq <= position < seq:
            raise InvalidArgument(f"{where}: position {position} is outside the prompt's {seq} tokens: give 0 to "
                                  f"{seq - 1} (or -{seq} to -1)")
        return [position % seq]
    if isinstance(position, slice) and all(v is None or _is_int(v) for v in (position.start, position.stop)) \
            and position.step in (None, 1):
        at = list(range(seq)[position])
        if not at and not (open_ended and position.stop is None):
            raise InvalidArgument(f"{where}: position {position} selects none of the prompt's {seq} tokens")
        return at + ([None] if open_ended and position.stop is None else [])
    raise InvalidArgument(f"{where}: position {position!r}: give an int, or a slice such as slice(3, None) "
                          f"(every position from 3{', new tokens included' if open_ended else ''})")


def _constrained(constrained_layers, blocks: int) -> bool:
    """Whether ``constrained_layers`` asks for direct effects (every block); None for the live model."""
    if constrained_layers is None:
        return False
    if isinstance(constrained_layers, (str, bytes)) or not isinstance(constrained_layers, (range, list, tuple)):
        raise InvalidType(f"constrained_layers takes None or the blocks range({blocks}), not "
                          f"{type(constrained_layers).__name__}")
    layers = list(constrained_layers)
    bad = [layer for layer in layers if not _is_int(layer) or not 0 <= layer < blocks]
    if bad or not layers:
        raise InvalidArgument(f"constrained_layers={constrained_layers!r}: give range({blocks}) (every block: direct "
                              f"effects) or None (the live model)" + (f"; {bad} are not blocks" if bad else ""))
    if set(layers) != set(range(blocks)):
        raise NotSupported(f"constrained_layers={sorted(set(layers))}: qgraph constrains every block (range({blocks}): "
                           f"the direct effects, the attribution graph's) or none (None)")
    return True


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class _Spliced:
    """The transcoders: ``request`` (what ``instrument(transcoders=...)`` and the replacement model take),
    ``blocks`` (spliced, in order), ``width`` (features per block), their encoders."""

    def __init__(self, transcoders, blocks: int, model):
        # lazy: qgraph.circuits.transcoders imports this module's package at import time (a cycle)
        from .transcoders import loaded
        transcoders = loaded(transcoders, blocks)
        self.request, self.cross = transcoders, isinstance(transcoders, CrossLayerTranscoder)
        if self.cross:
            if transcoders.n_layers != blocks:
                raise InvalidArgument(f"transcoders: {transcoders.source} has {transcoders.n_layers} blocks, the model "
                                      f"{blocks}: give the model's own cross-layer transcoder")
            self.blocks, self.width = list(range(blocks)), transcoders.d_transcoder
            return
        if not isinstance(transcoders, dict) or not transcoders:
            raise InvalidType(f"transcoders takes {{block: qgraph.Transcoder}}, a qgraph.CrossLayerTranscoder or a "
                              f"folder of either, not {type(transcoders).__name__}"
                              f"{' (empty)' if transcoders == {} else ''}")
        bad = [block for block in transcoders if not _is_int(block) or not 0 <= block < blocks]
        if bad:
            raise InvalidArgument(f"transcoders at blocks {bad}: the model has blocks 0 to {blocks - 1}")
        if any(not isinstance(tc, Transcoder) for tc in transcoders.values()):
            raise InvalidType("transcoders takes {block: qgraph.Transcoder} (or a CrossLayerTranscoder alone)")
        widths = {tc.d_sae for tc in transcoders.values()}
        if len(widths) > 1:
            raise InvalidArgument(f"the transcoders have {sorted(widths)} features: activations stack by block, so "
                                  f"give transcoders of one width")
        self.blocks, self.width = sorted(transcoders), widths.pop()

    def reads(self, block: int) -> str:
        return f"layers.{block}.{self.request.reads if self.cross else self.request[block].reads}"

    def instrument(self, model, features: bool):
        from ..instrument import instrument  # lazy: keeps safetensors, sympy, transformers out until this is used
        values = [f"layers.{b}.transcoder.features" if features else self.reads(b) for b in self.blocks]
        return instrument(model, values=values, transcoders=self.request)

    def encode(self, block: int, x: torch.Tensor, features: bool) -> torch.Tensor:
        if self.cross:
            return self.request.encode(block, x) if features else self.request.pre(block, x).to(x.dtype)
        tc = self.request[block]
        return tc.encode(x) if features else tc.pre(x).to(x.dtype)

    def activations(self, captured: dict, features: bool, wanted, seq: int, opened=()) -> torch.Tensor:
        """``[blocks, positions, width]`` from a run's features (or its inputs: pre-activations), the
        intervened entries set (``opened``: also at every position past the prompt)."""
        rows = []
        for block in self.blocks:
            row = captured[f"layers.{block}.transcoder.features"][0] if features else \
                self.encode(block, captured[self.reads(block)][0], False)
            row = row.clone()
            for b, p, f, v in wanted:
                if b == block:
                    row[p, f] = v
            for b, _, f, v in opened:
                if b == block:
                    row[seq:, f] = v
            rows.append(row)
        return torch.stack(rows)


def _by_block(wanted) -> dict[str, list]:
    edits: dict[str, list] = {}
    for block, position, feature, value in wanted:
        edits.setdefault(f"layers.{block}.transcoder.features", []).append((position, feature, value))
    return edits


class _Set:
    """The edit at one block's features: each ``(position, feature, value)`` set. In generation the first
    pass is the prompt's; the later one-token passes set the open-ended ones (position None) alone."""

    def __init__(self, entries, seq: int, generating: bool = False):
        self.entries, self.seq, self.generating, self.passes = entries, seq, generating, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        prompt = self.passes == 0 or not self.generating
        self.passes += 1
        out = x.clone()
        for position, feature, value in self.entries:
            if prompt and position is not None:
                out[:, position, feature] = value
            elif not prompt and position is None:
                out[:, :, feature] = value
        return out


# -- the frozen runs ---------------------------------------------------------------------------------
def _frozen_attention(ig, ids, edits):
    """The live program with the attention frozen: recorded on the clean run, replayed with the edits."""
    from ..export import export_model  # lazy: keeps transformers out until this is used
    from ..passes.replacement import ATTENTION, frozen  # lazy: keeps transformers out until this is used
    from ..program import Program  # lazy: keeps sympy, transformers out until this is used

    slots = {name: ig.slot(name) for name in edits}
    program = Program(ig.model, export_model(ig.model, images=False), transcoders=ig.transcoders)
    program.build(ig.values, slots, True, replacement=ATTENTION)
    mixing = sum(node.target is torch.ops.aten.scaled_dot_product_attention.default or node.target in DELTA_RULE_OPS
                 for node in program.graph.nodes)
    blocks = len(ig.family.block_mixers(ig.config))
    if mixing < blocks:
        raise NotSupported(f"freeze_attention holds sdpa's queries and keys and the delta-rule kernels' inputs; "
                           f"{blocks - mixing} of this model's {blocks} blocks mix positions otherwise "
                           f"(attn_implementation={attn_implementation(ig.config)!r}): load the model with "
                           f"attn_implementation='sdpa'")
    inputs = prepare(ig.model, None, ids[None])
    recorded: dict = {}
    with frozen(recorded):
        program.run(inputs, eager=True)
    with frozen(recorded, replay=True), applying({slots[name]: edit for name, edit in edits.items()}):
        return program.run(inputs, eager=True)


def _direct(model, ids, spliced, wanted, features: bool) -> Intervened:
    """Direct effects: the replacement model recorded on the clean run, replayed with each delta times its
    decoders added at the MLP outputs it writes (``inject_{block}``)."""
    from ..export import export_model  # lazy: keeps transformers out until this is used
    from ..passes.replacement import EMBEDDINGS, frozen, inject_name  # lazy: keeps transformers out until this is used
    from ..program import Program  # lazy: keeps sympy, transformers out until this is used
    # lazy: qgraph.circuits.transcoders imports this module's package at import time (a cycle)
    from .transcoders import TranscoderSet

    blocks, seq = spliced.blocks, len(ids)
    decoders = TranscoderSet(spliced.request, len(blocks))  # every block is spliced here
    program = Program(model, export_model(model, images=False))
    program.build([spliced.reads(b) for b in blocks], {}, True, replacement=spliced.request)
    parameter = next(model.parameters())
    ids = ids.to(parameter.device)
    zeros = torch.zeros(1, seq, input_embedding(model).embedding_dim, dtype=parameter.dtype, device=ids.device)
    inputs = {"input_ids": ids[None], "attention_mask": torch.ones(1, seq, dtype=torch.long, device=ids.device),
              **{name: zeros for name in (EMBEDDINGS, *(inject_name(b) for b in blocks))}}
    recorded: dict = {}
    with frozen(recorded):
        logits, moved = program.run(inputs)
    if wanted:
        deltas = {b: torch.zeros(1, seq, zeros.shape[-1], device=ids.device) for b in blocks}
        for block, position, feature, value in wanted:
            delta = value - float(moved[f"replacement.{block}.features"][0, position, feature])
            for j, decoder in decoders.decoders(block, torch.tensor([feature])):
                deltas[j][0, position] += delta * decoder[0].to(ids.device)
        inputs.update({inject_name(b): deltas[b].to(parameter.dtype) for b in blocks})
        with frozen(recorded, replay=True):
            logits, moved = program.run(inputs)
    rows = torch.stack([spliced.encode(b, moved[spliced.reads(b)][0], features) for b in blocks])
    for block, position, feature, value in wanted:
        rows[blocks.index(block), position, feature] = value
    return Intervened(logits, rows, tuple(blocks))
