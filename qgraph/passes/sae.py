"""Splice a sparse autoencoder into the graph at a value: its features, reconstruction and error
become nodes (and values: ``<host>.sae.features`` / ``.reconstruction`` / ``.error``).

At the value ``x`` (``layers.5.layer_output``) the rewrite adds

    features0 = encode(x)            the SAE's features of x
    features  = alias(features0)     the value ``sae.features``: an edit slot goes here
    recon0    = decode(features0)    what the SAE makes of x
    error     = x - recon0           the value ``sae.error``
    recon     = decode(features)     the value ``sae.reconstruction`` (of the edited features)
    activations, indices = topk(features, k)   for a TopK SAE, the sparse form: ``sae.activations``
                                               and ``sae.indices`` (int32), ``[batch seq k]``

and what reads ``x`` downstream reads, with ``splice="error"`` (the default), ``x + (recon - recon0)``
when the features can be edited (exactly ``x`` while they are not edited: the two decodes agree bit
for bit) and ``x`` itself otherwise; with ``splice="reconstruction"``, ``recon``. The value ``x``
itself stays what the model computed. ``encode`` and ``decode`` are the SAE's own methods, called as
submodules, so ``torch.compile`` traces them with the rest.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from .emit import emit_module, emitter
from .on_request import Rewrite

aten = torch.ops.aten
SPLICES = ("error", "reconstruction")


class _Call(torch.nn.Module):
    """One method of an SAE as a module (``call_module`` calls ``forward``)."""

    def __init__(self, sae: torch.nn.Module, method: str):
        super().__init__()
        self.sae, self.method = sae, method

    def forward(self, x):
        return getattr(self.sae, self.method)(x)


@dataclass(frozen=True, eq=False)
class SpliceSAE(Rewrite):
    """Splice ``sae`` at the value ``hook`` (``prefix`` names its values: ``<prefix>.sae.*``)."""

    sae: torch.nn.Module
    hook: str
    prefix: str
    splice: str = "error"
    note: str = field(default="asking for it splices the SAE at its value (encode, decode, error)")

    def apply(self, program, node: Node, name: str, option: dict) -> None:
        graph, module = program.graph, program.module
        stem = self.prefix.replace(".", "_")
        for method in ("encode", "decode"):
            module.add_submodule(f"sae__{stem}__{method}", _Call(self.sae, method))
        readers = list(node.users)
        editable = f"{self.prefix}.sae.features" in program.slots
        emit = emitter(graph, node)
        value = node.meta["val"]
        with value.fake_mode:
            wide = value.new_empty(*value.shape[:-1], self.sae.d_sae)
        with graph.inserting_before(node.next):  # in order, before what follows x
            features0 = emit_module(graph, node, f"sae__{stem}__encode", (node,), wide)
            features = emit(aten.alias.default, features0)
            recon0 = emit_module(graph, node, f"sae__{stem}__decode", (features0,), value)
            error = emit(aten.sub.Tensor, node, recon0)
            parts = {"features": features, "reconstruction": recon0, "error": error}
            if editable or self.splice == "reconstruction":
                parts["reconstruction"] = emit_module(graph, node, f"sae__{stem}__decode", (features,), value)
            if self.sae.k is not None:
                top = emit(aten.topk.default, features, self.sae.k)
                parts["activations"] = emit(operator.getitem, top, 0)
                parts["indices"] = emit(aten._to_copy.default, emit(operator.getitem, top, 1), dtype=torch.int32)
            out = node
            if self.splice == "reconstruction":
                out = parts["reconstruction"]
            elif editable:
                out = emit(aten.add.Tensor, node, emit(aten.sub.Tensor, parts["reconstruction"], recon0))
        for reader in readers:
            reader.replace_input_with(node, out)
        program.spliced[self.prefix] = parts
