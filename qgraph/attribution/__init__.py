"""Decompositions of the residual stream: direct logit attribution (``out.logit_attribution``) and the
residual stack (``out.residual_stack``), as TransformerLens's ``logit_attrs`` / ``decompose_resid`` /
``stack_head_results`` give them, for the Qwen3.5 blocks: the embedding, each block's mixer (per head:
an attention block's gated heads through ``o_proj``, a DeltaNet block's value heads through its gated
norm and ``out_proj``) and MLP (per routed expert and the gated shared expert on a mixture-of-experts
block), and the features of a spliced SAE or transcoder.

Which values, and from where: the decomposition reads a few values of the call (``writers.py`` says
which). Where the ``Output`` holds them all, they are used as they are, so the call's edits are in force
whatever they were; otherwise the call is run again through its instrument (``source.variant``) with its
tokens, attention mask and edits, and refused if that does not give back its logits (a call with images).
Which doors: a local instrument and a loaded program (its weights, by export target) decompose; a remote
instrument holds no weights, so it gives what needs none (a residual stack per component or block) and
refuses the rest by name (``sources.py``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import InvalidArgument, InvalidType, OutOfRange
from ..values.names import canonical
from .parts import Whole
from .results import LogitAttribution, ResidualStack
from .sources import Weights, values_for
from .writers import PER, check_reads, plan, point_of

__all__ = ["LogitAttribution", "ResidualStack", "logit_attribution", "residual_stack"]


def logit_attribution(out, tokens, against=None, *, positions=None, per: str = "head") -> LogitAttribution:
    """What ``Output.logit_attribution`` returns (see there)."""
    source, per = _source(out), _per(per)
    weights = Weights(source)
    writers = plan(source, weights, 2 * out.blocks, through=True)
    values, logits, where = _values(out, check_reads(writers, per, source, weights), positions)
    parts, bias = _pieces(writers, values, weights, per, source)
    stream = sum((part.total() for part in parts), torch.zeros(())) + sum(bias.values(), torch.zeros(()))
    norm, head = source.family.readout
    # the final norm, its scale frozen at the call's own: x * rsqrt(mean(x²) + eps) * (1 + weight), the
    # zero-centred RMSNorm of every family qgraph knows
    scale = torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + source.config.get_text_config().rms_norm_eps)
    gain = 1 + weights(f"{norm}.weight")
    batch, device = stream.shape[0], stream.device
    ids = _ids(tokens, batch, len(where), "tokens", source).to(device)
    other = None if against is None else _ids(against, batch, len(where), "against", source).to(device)
    readout = weights(f"{head}.weight", rows=ids).float()  # the rows asked, not a float32 copy of the head
    readout = readout if other is None else readout - weights(f"{head}.weight", rows=other).float()
    direction = readout * gain * scale  # [batch, positions, hidden]
    attributions = torch.cat([part.project(direction) for part in parts])
    scores = {label: (vectors * direction).sum(-1) for label, vectors in bias.items()}
    if weights.has(f"{head}.bias"):
        offset = weights(f"{head}.bias", rows=ids).float()
        scores[f"{head}.bias"] = offset if other is None else offset - weights(f"{head}.bias", rows=other).float()
    if logits is not None:
        chosen = logits.detach().float()[:, where].to(device)
        total = chosen.gather(-1, ids[..., None])[..., 0]
        total = total if other is None else total - chosen.gather(-1, other[..., None])[..., 0]
    else:  # a call without logits: what the final norm and the head make of the stream
        total = (stream * direction).sum(-1) + scores.get(f"{head}.bias", 0)
    return LogitAttribution([label for part in parts for label in part.labels], attributions, scores, total, where,
                            ids, other, out.input_ids, source)


def residual_stack(out, name: str, *, per: str = "component", positions=None) -> ResidualStack:
    """What ``Output.residual_stack`` returns (see there)."""
    source, per = _source(out), _per(per)
    if not isinstance(name, str):
        raise InvalidType(f"residual_stack takes a residual value's name, not {type(name).__name__}")
    key = canonical(name, out.blocks, out.aliases)
    point = point_of(key, out.blocks)
    weights = Weights(source)
    writers = plan(source, weights, point, through=False)
    names = check_reads(writers, per, source, weights)
    values, _, where = _values(out, list(dict.fromkeys([*names, key])), positions)
    parts, bias = _pieces(writers, values, weights, per, source)
    parts = [Whole(part.whole, part.total()) if getattr(part, "whole", "") else part for part in parts]
    stack = torch.cat([part.vectors() for part in parts])
    return ResidualStack(key, [label for part in parts for label in part.labels], stack, bias, values[key], where,
                         out.input_ids, source)


def _pieces(writers, values: dict, weights, per: str, source) -> tuple[list, dict]:
    """Every writer's pieces and bias terms; at ``per="block"`` a block's writers summed into one."""
    parts, bias = [], {}
    for writer in writers:
        made, terms = writer.pieces(values, weights, per, source)
        parts += [(writer.block, part) for part in made]
        bias.update(terms)
    if per != "block":
        return [part for _, part in parts], bias
    blocks: list = []
    for block, part in parts:
        if block is not None and blocks and blocks[-1][0] == block:
            blocks[-1] = (block, Whole(f"layers.{block}", blocks[-1][1].total() + part.total()))
        else:
            blocks.append((block, part if block is None else Whole(f"layers.{block}", part.total())))
    return [part for _, part in blocks], bias


def _values(out, names: list[str], positions) -> tuple[dict[str, Tensor], Tensor | None, list[int]]:
    """The values ``names`` at ``positions`` (floats as float32, detached), the call's logits, the positions."""
    values, logits = values_for(out, names)
    seq = values[names[0]].shape[1]
    where = _positions(positions, seq)
    index = torch.tensor(where)
    picked = {}
    for name in names:
        value = values[name].detach()
        value = value.index_select(1, index.to(value.device))
        picked[name] = value.float() if value.is_floating_point() else value
    return picked, logits, where


def _positions(positions, seq: int) -> list[int]:
    if positions is None:
        return list(range(seq))
    asked = [positions] if isinstance(positions, int) else positions
    if isinstance(asked, (str, bytes)) or not isinstance(asked, Sequence) or not asked:
        raise InvalidType(f"positions= takes an int or a list of ints, not {positions!r}")
    bad = [p for p in asked if not isinstance(p, int) or isinstance(p, bool) or not -seq <= p < seq]
    if bad:
        raise OutOfRange(f"positions {bad} are not token positions of a {seq}-token call (give ints in "
                         f"[-{seq}, {seq}))")
    return [p % seq for p in asked]


def _ids(tokens, batch: int, positions: int, what: str, source) -> Tensor:
    """``tokens`` as ids ``[batch, positions]``: an int (every row and position), one per batch row (a list or a
    ``[batch]`` tensor), or one per row and position (``[batch, positions]``)."""
    if isinstance(tokens, str) or (isinstance(tokens, Sequence) and any(isinstance(t, str) for t in tokens)):
        raise InvalidType(f"{what}= takes token ids, not strings: tokenizer.convert_tokens_to_ids(...) or "
                          f"tokenizer(text)['input_ids'] give them")
    try:
        ids = torch.as_tensor(tokens)
    except (TypeError, ValueError, RuntimeError):
        raise InvalidType(f"{what}= takes an int, a list of ints (one per batch row) or a [batch, positions] "
                          f"tensor, not {type(tokens).__name__}") from None
    if ids.is_floating_point() or ids.dtype == torch.bool or ids.is_complex():
        raise InvalidType(f"{what}= takes integer token ids, not {ids.dtype}")
    if ids.dim() == 1 and ids.shape[0] == batch:
        ids = ids[:, None]
    if ids.dim() > 2 or (ids.dim() == 2 and (ids.shape[0] != batch or ids.shape[1] not in (1, positions))) or \
            (ids.dim() == 1):
        raise InvalidArgument(f"{what}= has shape {tuple(ids.shape)}: give an int, one id per batch row ({batch}) or "
                              f"one per row and position [{batch}, {positions}]")
    vocab = source.config.get_text_config().vocab_size
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise OutOfRange(f"{what}= holds ids outside the vocabulary [0, {vocab})")
    return ids.long().expand(batch, positions)


def _source(out):
    source = getattr(out, "source", None)
    if source is None or getattr(source, "family", None) is None:
        raise InvalidType("this Output does not say which model made it (out.source): decompose an Output of a call "
                          "to qgraph.instrument(model), a loaded program or a remote instrument")
    return source


def _per(per: str) -> str:
    if per not in PER:
        raise InvalidArgument(f"per={per!r}: give one of {PER} (heads, experts and features; each block's mixer and "
                              f"MLP; each block)")
    return per
