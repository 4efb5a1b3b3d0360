"""Splice a sparse autoencoder into the graph at a value: its features, reconstruction and error
become nodes (and values: ``<hook>.sae.features`` / ``.reconstruction`` / ``.error``, ``values.saes``).

At the value ``x`` (``layers.5.layer_output``) the rewrite adds

    features0 = encode(x)            the SAE's features of x; for a TopK SAE
                                     dense(*select(x)), its encoder's own selection kept as ``chosen``
    features  = alias(features0)     the value ``sae.features`` (a marker per name of it): an edit
                                     slot goes here
    recon0    = decode(features0)    what the SAE makes of x
    error     = x - recon0           the value ``sae.error``
    recon     = decode(features)     the value ``sae.reconstruction`` (of the edited features)
    activations = features.gather(-1, chosen)   for a TopK SAE, the sparse form: ``sae.activations``
    indices     = int32(chosen)                 and ``sae.indices``, ``[batch seq k]``

and what reads ``x`` downstream reads, with ``splice="error"`` (the default), ``x + (recon - recon0)``
when the features can be edited (exactly ``x`` while they are not edited: the two decodes agree bit
for bit) and ``x`` itself otherwise; with ``splice="reconstruction"``, ``recon``. The value ``x``
itself stays what the model computed. ``select``, ``dense``, ``encode`` and ``decode`` are the SAE's
own methods, called as submodules (named after the hook, so SAEs at several values of one block
each have their own), so ``torch.compile`` traces them with the rest.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from ..edits import EditError
from ..kernels.ops import MARK_OP
from .emit import MethodCall, emit_module, emitter
from .on_request import Rewrite

aten = torch.ops.aten
SPLICES = ("error", "reconstruction")


@dataclass(frozen=True, eq=False)
class SpliceSAE(Rewrite):
    """Splice ``sae`` at the value ``hook``; ``prefixes`` name its values (``<prefix>.sae.*``)."""

    sae: torch.nn.Module
    hook: str
    prefixes: tuple[str, ...]
    splice: str = "error"
    note: str = field(default="asking for it splices the SAE at its value (encode, decode, error)")

    def apply(self, program, node: Node, name: str, option: dict) -> None:
        graph, module, sae = program.graph, program.module, self.sae
        stem = f"sae__{self.hook.replace('.', '_')}__"
        methods = {"encode": "encode", "decode": "decode"} if sae.k is None else \
            {"encode": "select", "dense": "dense", "decode": "decode"}
        for target, method in methods.items():
            module.add_submodule(stem + target, MethodCall(sae, method))
        readers = list(node.users)
        edited = [f"{prefix}.sae.features" for prefix in self.prefixes if f"{prefix}.sae.features" in program.slots]
        if len(edited) > 1:  # two slots on one tensor: each name would read its own
            raise EditError(f"{' and '.join(map(repr, edited))} are one tensor: edit it under one name")
        editable = bool(edited)
        emit = emitter(graph, node)
        value = node.meta["val"]
        with graph.inserting_before(node.next):  # in order, before what follows x
            features0, chosen = emit_features(graph, emit, node, stem, node, sae)
            features = emit(aten.alias.default, features0)
            recon0 = emit_module(graph, node, stem + "decode", (features0,), value)
            error = emit(aten.sub.Tensor, node, recon0)
            parts = {"features": features, "reconstruction": recon0, "error": error}
            if editable or self.splice == "reconstruction":
                parts["reconstruction"] = emit_module(graph, node, stem + "decode", (features,), value)
            if sae.k is not None:
                parts["activations"] = emit(aten.gather.default, features, -1, chosen)
                parts["indices"] = emit(aten._to_copy.default, chosen, dtype=torch.int32)
            out = node
            if self.splice == "reconstruction":
                out = parts["reconstruction"]
            elif editable:
                out = emit(aten.add.Tensor, node, emit(aten.sub.Tensor, parts["reconstruction"], recon0))
            # each name of the features marks the one tensor: an edit under any name reaches all of them
            named = {f"{prefix}.sae.{part}": emit(MARK_OP, features, f"{prefix}.sae.{part}") if part == "features"
                     else found for prefix in self.prefixes for part, found in parts.items()}
        for reader in readers:
            reader.replace_input_with(node, out)
        program.spliced[self.hook] = named


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
