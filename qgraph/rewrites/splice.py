"""Splice a dictionary (a sparse autoencoder, a per-layer transcoder) into the graph: its features,
reconstruction and error become nodes (and values, ``values.dictionaries``: ``<hook>.sae.*`` of an SAE
at a value, ``layers.{i}.transcoder.*`` of a transcoder across block i's MLP).

A dictionary stands in for the value ``m`` at the node the rewrite is applied at, and reads the value
``x``: an SAE reads what it stands in for (``x`` is ``m``: ``layers.5.layer_output``); a transcoder
reads its block's MLP input (``layers.{i}.mlp_input``) and stands in for the MLP's output
(``layers.{i}.mlp.mlp_output``). After ``m`` the rewrite adds

    features0 = encode(x)            the dictionary's features of x; for a TopK one
                                     dense(*select(x)), its encoder's own selection kept as ``chosen``
    features  = alias(features0)     the value ``features`` (a marker per name of it): an edit
                                     slot goes here
    decoded0  = decode(features0)    features0 @ W_dec + b_dec
    s         = skip(x)              x @ W_skip (a transcoder's skip path, only where it has one)
    recon0    = decoded0 + s         what the dictionary makes of x (decoded0 itself without a skip)
    error     = m - recon0           the value ``error``
    decoded   = decode(features)     (of the edited features)
    recon     = decoded + s          the value ``reconstruction``
    activations = features.gather(-1, chosen)   for a TopK dictionary, the sparse form: ``activations``
    indices     = int32(chosen)                 and ``indices``, ``[batch seq k]``

and what reads ``m`` downstream reads, with ``splice="error"`` (the default), ``m + (decoded - decoded0)``
when the features can be edited (exactly ``m`` while they are not edited: the two decodes agree bit
for bit; the change is taken between the decodes, where the skip path, in both reconstructions,
cancels exactly) and ``m`` itself otherwise; with ``splice="reconstruction"``, ``recon``. The value
``m`` itself stays what the model computed. ``select``, ``dense``, ``encode``, ``decode`` and ``skip``
are the dictionary's own methods, called as submodules named after ``stem`` (SAEs at several values
of one block each have their own), so ``torch.compile`` traces them with the rest.

A cross-layer transcoder (``rewrites.clt``) is its own rewrite, as it spans blocks, but emits its
features, reconstruction, error and names with the functions here.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from ..edits import EditError
from ..kernels.ops import MARK_OP
from .emit import MethodCall, emit_module, emitter
from .on_request import Rewrite

aten = torch.ops.aten
SPLICES = ("error", "reconstruction")


@dataclass(frozen=True, eq=False)
class SpliceDictionary(Rewrite):
    """Splice ``dictionary`` (an SAE, a transcoder) standing in for the node it is applied at and
    reading ``source`` (None: that node itself, as an SAE does); ``prefixes`` name its values
    (``<prefix>.features``: ``layers.5.layer_output.sae`` and ``layers.5.sae``, or
    ``layers.3.transcoder``), ``stem`` its submodules (``sae__layers_5_layer_output__``)."""

    dictionary: torch.nn.Module
    prefixes: tuple[str, ...]
    stem: str
    source: Node | None = None
    splice: str = "error"
    note: str = Rewrite.note

    def apply(self, program, node: Node, name: str, option: dict) -> None:
        graph, module, dictionary, stem = program.graph, program.module, self.dictionary, self.stem
        x = node if self.source is None else self.source
        skips = getattr(dictionary, "W_skip", None) is not None
        methods = {"encode": "encode", "decode": "decode"} if dictionary.k is None else \
            {"encode": "select", "dense": "dense", "decode": "decode"}
        for target, method in (*methods.items(), *((("skip", "skip"),) if skips else ())):
            module.add_submodule(stem + target, MethodCall(dictionary, method))
        readers = list(node.users)
        edited = [f"{prefix}.features" for prefix in self.prefixes if f"{prefix}.features" in program.slots]
        if len(edited) > 1:  # two slots on one tensor: each name would read its own
            raise EditError(f"{' and '.join(map(repr, edited))} are one tensor: edit it under one name")
        emit = emitter(graph, node)
        with graph.inserting_before(node.next):  # in order, after m (x comes before it, or is it)
            features0, chosen = emit_features(graph, emit, node, stem, x, dictionary)
            features = emit(aten.alias.default, features0)
            parts, out = emit_outputs(graph, emit, node, stem + "decode", (features0,), (features,),
                                      stem + "skip" if skips else None, x, bool(edited), self.splice)
            parts = {"features": features, **parts}
            if dictionary.k is not None:
                parts["activations"] = emit(aten.gather.default, features, -1, chosen)
                parts["indices"] = emit(aten._to_copy.default, chosen, dtype=torch.int32)
            named = name_parts(emit, self.prefixes, parts)
        for reader in readers:
            reader.replace_input_with(node, out)
        program.spliced.update(named)


def emit_features(graph, emit, scope: Node, stem: str, source: Node, encoder) -> tuple[Node, Node | None]:
    """The dense features of ``source`` by ``encoder``'s submodules ``stem + "encode"`` (and, for a TopK
    one, ``"dense"`` of its encoder's own selection), carrying ``scope``'s module scope; returns them
    and the selection's indices (None unless TopK)."""
    value = scope.meta["val"]
    with value.fake_mode:
        wide = value.new_empty(*value.shape[:-1], encoder.d_sae)
    if encoder.k is None:
        return emit_module(graph, scope, stem + "encode", (source,), wide), None
    selected = emit_module(graph, scope, stem + "encode", (source,), wide)
    with value.fake_mode:
        narrow = value.new_empty(*value.shape[:-1], encoder.k)
        selected.meta["val"] = (narrow, narrow.long())
    chosen = emit(operator.getitem, selected, 1)
    return emit_module(graph, scope, stem + "dense", (emit(operator.getitem, selected, 0), chosen), wide), chosen


def emit_outputs(graph, emit, node: Node, decode: str, original: tuple, features: tuple, skip: str | None,
                 source: Node, changed: bool, splice: str) -> tuple[dict[str, Node], Node]:
    """The ``reconstruction`` and ``error`` of a dictionary standing in for ``node``, and what the
    node's readers read instead of it (the formulas of the module docstring): the submodule ``decode``
    reads ``original`` (the unedited features) and ``features`` (as edited), ``skip`` (None: no skip
    path) reads ``source``; ``changed`` says whether the features can be edited."""
    value = node.meta["val"]
    decoded0 = emit_module(graph, node, decode, original, value)
    s = emit_module(graph, node, skip, (source,), value) if skip is not None else None
    recon0 = decoded0 if s is None else emit(aten.add.Tensor, decoded0, s)
    parts, out = {"reconstruction": recon0, "error": emit(aten.sub.Tensor, node, recon0)}, node
    if changed or splice == "reconstruction":
        decoded = emit_module(graph, node, decode, features, value)
        parts["reconstruction"] = decoded if s is None else emit(aten.add.Tensor, decoded, s)
        out = parts["reconstruction"] if splice == "reconstruction" else \
            emit(aten.add.Tensor, node, emit(aten.sub.Tensor, decoded, decoded0))
    return parts, out


def name_parts(emit, prefixes: tuple[str, ...], parts: dict[str, Node]) -> dict[str, Node]:
    """``{"<prefix>.<part>": node}`` for every prefix and part; each name of the features marks the one
    tensor (``parts["features"]``), so an edit under any name reaches all of them."""
    return {f"{prefix}.{part}": emit(MARK_OP, found, f"{prefix}.{part}") if part == "features" else found
            for prefix in prefixes for part, found in parts.items()}
