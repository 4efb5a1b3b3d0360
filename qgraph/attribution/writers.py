"""What writes the residual stream up to a point, and the values each writer is computed from.

The stream of a model of ``B`` blocks is a sum of ``2B + 1`` writes: the embedding (index 0), then each
block ``i``'s mixer (``2i + 1``) and MLP (``2i + 2``). The stream at a point is the sum of the writes up
to it: ``layers.{i}.layer_input`` is point ``2i``, ``layer_mid`` ``2i + 1``, ``layer_output`` ``2i + 2``,
and the final norm reads point ``2B``.

Each writer gives its pieces (``parts.py``) at one of three grains (``per``): ``"head"`` splits a
mixer into its heads (what the output projection reads, ``o_proj.input`` / ``out_proj.input``, one slice
per head), a mixture-of-experts MLP into its routed experts and its gated shared expert, and a dictionary
into its features (with its decoder bias, its transcoder skip path and its error as bias terms);
``"component"`` keeps each writer whole (a mixer's ``attention_output``, an MLP's ``mlp_output``, a
dictionary's reconstruction plus error); ``"block"`` sums a block's writers.

A dictionary stands in for what it splices at, so the decomposition runs through it: an SAE at a
block's ``mlp_output`` or mixer ``attention_output``, or a transcoder across block ``i``'s MLP, replaces
that writer; an SAE at a residual point (``layers.{i}.layer_output``, ``layer_mid``, ``layer_input``)
replaces every writer up to that point, for the stream after it (the value at the point itself is what
the model computed there). Either way its pieces sum to what the model reads downstream, under either
splice and with its features edited. An SAE elsewhere (at neurons, at a mixer's heads) leaves the writer
whole, and one at a value a writer is computed from is refused by name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidArgument, NotSupported
from ..saes.transcoder import Transcoder
from .parts import Experts, Linear, Whole

PER = ("head", "component", "block")


@dataclass
class Writer:
    """One write to the stream: its ``label`` (a dictionary's is the prefix of its values, ``layers.1.sae``
    or ``layers.2.transcoder``), its ``block`` (None for the embedding and an SAE at a residual point), and
    ``kind``: "embed", a mixer's module, "mlp", or "dictionary" with ``dictionary`` and its ``splice``."""

    label: str
    block: int | None
    kind: str
    dictionary: Any = None  # an SAE or a Transcoder
    splice: str = "error"

    def needs(self, per: str, source) -> list[str]:
        """The values its pieces at ``per`` are computed from."""
        if self.kind == "embed":
            return ["layers.0.layer_input"]
        if self.kind == "dictionary":
            skip = getattr(self.dictionary, "W_skip", None) is not None  # a transcoder's skip reads its input
            return [f"{self.label}.features"] + [f"{self.label}.error"] * (self.splice == "error") + \
                [f"layers.{self.block}.{getattr(self.dictionary, 'reads', '')}"] * skip
        heads = _heads(source, self.kind)
        if per != "head":
            return [f"{self.label}.attention_output" if self.kind != "mlp" else f"{self.label}.mlp_output"]
        if heads is not None:
            return [f"{self.label}.{heads[0]}.input"]
        if experts_of(source):
            return [f"{self.label}.{name}" for name in ("experts_neurons", "router_indices", "router_weights",
                                                         "shared_expert_output", "shared_expert_gate")]
        return [f"{self.label}.mlp_output"]

    def pieces(self, values: dict, weights, per: str, source) -> tuple[list, dict]:
        """``(parts, bias)``: its pieces at ``per`` from ``values`` (float32, at the positions asked) and
        ``weights``, and its bias terms ``{label: vectors}`` (at ``"head"`` only: coarser, each writer is
        one ``Whole`` with its bias inside)."""
        value = {name: values[name] for name in self.needs(per, source)}
        if self.kind == "dictionary":
            parts, bias = self._features(value)
        elif _heads(source, self.kind) is not None and per == "head":
            parts, bias = self._heads(value, weights, source)
        elif self.kind == "mlp" and per == "head" and experts_of(source):
            parts, bias = self._experts(value, weights, source)
        else:
            return [Whole(self.label, next(iter(value.values())))], {}
        if per == "head":
            return parts, bias
        return [Whole(self.label, sum((p.total() for p in parts), torch.zeros(())) + sum(bias.values()))], {}

    def _heads(self, value: dict, weights, source):
        """A mixer's heads: what its output projection reads, one slice per head, through that slice."""
        module, dim = _heads(source, self.kind) or ("", "")
        projection = f"{self.label}.{module}"
        read = value[f"{projection}.input"]
        heads = source.family.dim(source.config, dim)
        matrix = weights(f"{projection}.weight")  # [hidden, heads * head_dim]
        matrices = matrix.T.reshape(heads, -1, matrix.shape[0])
        bias = {f"{projection}.bias": weights(f"{projection}.bias").expand(*read.shape[:-1], -1)} \
            if weights.has(f"{projection}.bias") else {}
        return [Linear([f"{self.label}.head.{h}" for h in range(heads)], read.unflatten(-1, (heads, -1)),
                       matrices)], bias

    def _experts(self, value: dict, weights, source):
        """A mixture-of-experts MLP: each routed expert, and the shared expert through its sigmoid gate."""
        experts = experts_of(source) or 0
        down = weights(f"{self.label}.{source.family.experts_down}", rows=...)  # [experts, hidden, inner], as stored
        neurons = value[f"{self.label}.experts_neurons"]
        if down.dim() != 3 or down.shape[0] != experts or down.shape[2] != neurons.shape[-1]:
            raise NotSupported(f"{self.label}.{source.family.experts_down} has shape {tuple(down.shape)}, not "
                               f"[experts, hidden, intermediate]: this experts layout is not split per expert; use "
                               f"per='component'")
        routed = Experts([f"{self.label}.expert.{e}" for e in range(experts)], neurons,
                         value[f"{self.label}.router_indices"].long(), value[f"{self.label}.router_weights"], down)
        shared = torch.sigmoid(value[f"{self.label}.shared_expert_gate"]) * value[f"{self.label}.shared_expert_output"]
        return [routed, Whole(f"{self.label}.shared_expert", shared)], {}

    def _features(self, value: dict):
        """A dictionary's features (each its activation times its decoder row) and its bias terms: its
        decoder bias, a transcoder's skip path, and its error where the model reads it (splice="error")."""
        features, decoder = value[f"{self.label}.features"], self.dictionary.W_dec.detach().float()
        parts = [Linear([f"{self.label}.feature.{k}" for k in range(decoder.shape[0])], features[..., None],
                        decoder[:, None, :], whole=f"{self.label}.features")]
        bias = {f"{self.label}.b_dec": self.dictionary.b_dec.detach().float().expand(*features.shape[:-1], -1)}
        if getattr(self.dictionary, "W_skip", None) is not None:
            bias[f"{self.label}.skip"] = self.dictionary.skip(value[f"layers.{self.block}.{self.dictionary.reads}"])
        if self.splice == "error":
            bias[f"{self.label}.error"] = value[f"{self.label}.error"]
        return parts, bias


def _heads(source, kind: str) -> tuple[str, str] | None:
    """A mixer's (output projection, heads dim) as its family declares them (``Mixer.heads``); None for
    what has no heads (the MLP, the embedding, a dictionary) or a mixer that declares none."""
    return next((mixer.heads for mixer in source.family.mixers.values() if mixer.module == kind), None)


def experts_of(source) -> int | None:
    """The experts of a mixture-of-experts family's MLPs (on every block), None for a dense one (or one
    that does not declare its experts' down projection: ``Family.experts_down``)."""
    return source.family.dim(source.config, "num_experts") if source.family.experts_down else None


# -- the plan ----------------------------------------------------------------------------------------------


def point_of(name: str, blocks: int) -> int:
    """The stream index of a residual value (see the module's docstring); a named error for any other value."""
    found = re.fullmatch(r"layers\.(\d+)\.(layer_input|layer_mid|layer_output)", name)
    if not found or int(found.group(1)) >= blocks:
        raise InvalidArgument(f"'{name}' is not a residual-stream value: give layers.{{i}}.layer_input, layer_mid or "
                              f"layer_output (or their TransformerLens names, blocks.{{i}}.hook_resid_pre/mid/post); "
                              f"what the final norm reads is layers[-1].layer_output")
    return 2 * int(found.group(1)) + ("layer_input", "layer_mid", "layer_output").index(found.group(2))


def plan(source, weights, point: int, through: bool) -> list[Writer]:
    """The writers of the stream at ``point``, in order, dictionaries in place: an SAE at a residual point
    counts where it is before ``point`` (or at it, with ``through``: what reads the point reads the SAE's)."""
    mixers = source.family.block_mixers(source.config)
    writers = [Writer("embed", None, "embed")]
    for i, mixer in enumerate(mixers):
        writers += [Writer(f"layers.{i}.{mixer}", i, mixer), Writer(f"layers.{i}.mlp", i, "mlp")]
    writers = writers[:point + 1]
    _check_dictionaries(source, weights)
    for block, (tc, splice) in weights.transcoders.items():
        if not isinstance(tc, Transcoder):
            raise NotSupported("a cross-layer transcoder's features each write to every later block's MLP output, "
                               "which this decomposition does not split: decompose an instrument without it")
        if 2 * block + 2 <= point:
            writers[2 * block + 2] = Writer(f"layers.{block}.transcoder", block, "dictionary", tc, splice)
    residual = []
    for hook, (sae, splice) in weights.saes.items():
        at = _splice_point(hook, mixers)
        if at is not None and not at[1] and at[0] <= point:  # at a writer's output: in its place
            writers[at[0]] = Writer(f"{hook}.sae", (at[0] - 1) // 2, "dictionary", sae, splice)
        elif at is not None and at[1] and (at[0] < point or (through and at[0] == point)):
            residual.append((at[0], Writer(f"{hook}.sae", None, "dictionary", sae, splice)))
    if not residual:
        return writers
    start, last = max(residual, key=lambda placed: placed[0])  # it stands for every write before it
    return [last] + writers[start + 1:]


def _splice_point(hook: str, mixers: list[str]) -> tuple[int, bool] | None:
    """``(stream index, at a residual point)`` of an SAE's value, or None where it is neither a residual
    point nor a writer's output (it leaves the writers whole)."""
    if hook in ("token_embeddings", "embed_tokens.output"):
        return 0, True
    found = re.fullmatch(r"layers\.(\d+)\.(.+)", hook)
    if not found:
        return None
    i, rest = int(found.group(1)), found.group(2)
    residual = {"layer_input": 2 * i, "input": 2 * i, "layer_mid": 2 * i + 1, "layer_output": 2 * i + 2,
                "output": 2 * i + 2}
    if rest in residual:
        return residual[rest], True
    if rest in ("mlp.mlp_output", "mlp.output"):
        return 2 * i + 2, False
    if rest in (f"{mixers[i]}.attention_output", f"{mixers[i]}.output"):
        return 2 * i + 1, False
    return None


def _check_dictionaries(source, weights) -> None:
    """A program whose catalogue has dictionary values but whose dictionaries are not at hand is refused."""
    if weights.saes or weights.transcoders:
        return
    spliced = [name for name in source.catalogue if name.endswith((".sae.features", ".transcoder.features"))]
    if spliced:
        raise NotSupported(f"this program has dictionaries spliced ({', '.join(spliced[:3])}) whose weights it does "
                           f"not hand out: decompose with qgraph.instrument(model, saes=..., transcoders=...)")


def check_reads(writers: list[Writer], per: str, source, weights) -> list[str]:
    """The values the writers at ``per`` read, once each; a named error where an SAE splices at one of them
    in a way the writers do not follow (at a value other than a residual point or a writer's output)."""
    names = list(dict.fromkeys(name for writer in writers for name in writer.needs(per, source)))
    mixers = source.family.block_mixers(source.config)
    stray = [hook for hook in weights.saes if hook in names and _splice_point(hook, mixers) is None]
    if stray:
        raise NotSupported(f"the SAE at '{stray[0]}' stands in for a value the decomposition reads at per='{per}': "
                           f"decompose at a coarser per= (or splice the SAE elsewhere)")
    return names
