"""Splice a per-layer transcoder across a block's MLP: it reads the MLP's input and stands in for its
output; its features, reconstruction and error become nodes (and values: ``layers.{i}.transcoder.*``,
``values.transcoders``).

At block ``i``, with ``x`` the value it reads (``layers.{i}.mlp_input``) and ``m`` the MLP's output
(``layers.{i}.mlp.mlp_output``), the rewrite adds, after ``m``:

    features0 = encode(x)            the transcoder's features; for a TopK transcoder
                                     dense(*select(x)), its encoder's own selection kept as ``chosen``
    features  = alias(features0)     the value ``transcoder.features`` (marked): an edit slot goes here
    decoded0  = decode(features0)    features0 @ W_dec + b_dec
    s         = skip(x)              x @ W_skip (only where it has one)
    recon0    = decoded0 + s         what the transcoder makes of x
    error     = m - recon0           the value ``transcoder.error``
    decoded   = decode(features)     (of the edited features)
    recon     = decoded + s          the value ``transcoder.reconstruction``
    activations, indices             for a TopK transcoder, its sparse form, as an SAE's

and what reads ``m`` reads, with ``splice="error"`` (the default), ``m + (decoded - decoded0)`` when
the features can be edited (exactly ``m`` while they are not: the two decodes agree bit for bit) and
``m`` itself otherwise; with ``splice="reconstruction"``, ``recon``. This is ``passes.sae.SpliceSAE``
with the encoder reading another node than the one it stands in for, a skip path, and the change
taken between the decodes (the skip path, in both reconstructions, cancels exactly there).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Node

from ..kernels.ops import MARK_OP
from .emit import MethodCall, emit_module, emitter
from .on_request import Rewrite
from .sae import emit_features

aten = torch.ops.aten


@dataclass(frozen=True, eq=False)
class SpliceTranscoder(Rewrite):
    """Splice ``transcoder`` across block ``layer``'s MLP: it reads the node ``source`` (the value it
    reads) and stands in for the node it is applied at (the MLP's output)."""

    transcoder: torch.nn.Module
    layer: int
    source: Node
    splice: str = "error"
    note: str = field(default="asking for it splices the transcoder across the block's MLP (encode its input, "
                              "decode, error at its output)")

    @property
    def prefix(self) -> str:
        return f"layers.{self.layer}.transcoder"

    def apply(self, program, node: Node, name: str, option: dict) -> None:
        graph, module, tc, x = program.graph, program.module, self.transcoder, self.source
        stem = f"transcoder__layers_{self.layer}__"
        methods = {"encode": "encode", "decode": "decode"} if tc.k is None else \
            {"encode": "select", "dense": "dense", "decode": "decode"}
        if tc.W_skip is not None:
            methods["skip"] = "skip"
        for target, method in methods.items():
            module.add_submodule(stem + target, MethodCall(tc, method))
        readers = list(node.users)
        editable = f"{self.prefix}.features" in program.slots
        emit = emitter(graph, node)
        value = node.meta["val"]
        with graph.inserting_before(node.next):  # in order, after the MLP's output (x comes before it)
            features0, chosen = emit_features(graph, emit, node, stem, x, tc)
            features = emit(aten.alias.default, features0)
            decoded0 = emit_module(graph, node, stem + "decode", (features0,), value)
            skip = emit_module(graph, node, stem + "skip", (x,), value) if tc.W_skip is not None else None
            recon0 = decoded0 if skip is None else emit(aten.add.Tensor, decoded0, skip)
            parts = {"features": features, "reconstruction": recon0, "error": emit(aten.sub.Tensor, node, recon0)}
            out = node
            if editable or self.splice == "reconstruction":
                decoded = emit_module(graph, node, stem + "decode", (features,), value)
                parts["reconstruction"] = decoded if skip is None else emit(aten.add.Tensor, decoded, skip)
                out = parts["reconstruction"] if self.splice == "reconstruction" else \
                    emit(aten.add.Tensor, node, emit(aten.sub.Tensor, decoded, decoded0))
            if tc.k is not None:
                parts["activations"] = emit(aten.gather.default, features, -1, chosen)
                parts["indices"] = emit(aten._to_copy.default, chosen, dtype=torch.int32)
            named = {f"{self.prefix}.{part}": emit(MARK_OP, features, f"{self.prefix}.{part}") if part == "features"
                     else found for part, found in parts.items()}
        for reader in readers:
            reader.replace_input_with(node, out)
        program.spliced[self.prefix] = named
