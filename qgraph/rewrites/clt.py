"""Splice a cross-layer transcoder (``saes.clt.CrossLayerTranscoder``) across every block's MLP: block
i's features read its MLP input and their decoders write the MLP outputs of blocks i..n-1; each
block's features, reconstruction and error become nodes (the values ``layers.{i}.transcoder.*``,
``values.dictionaries``).

The splice is one rewrite of the whole program, made when any of the CLT's values is asked for (or
its features edited): a block's reconstruction reads the features of every block before it, and an
edit of block i's features reaches every later block's MLP output. At each block j, with ``x_j`` the
value it reads (``layers.{j}.mlp_input``) and ``m_j`` its MLP's output, after ``m_j``:

    features0_j = encode(j, x_j)                       the features of block j
    features_j  = alias(features0_j)                   the value ``transcoder.features`` (marked): an
                                                       edit slot goes here
    decoded0_j  = decode_to(j, features0_0..j)         what the unedited features write to block j
    s_j         = skip(j, x_j)                         x_j @ W_skip[j] (only where it has one)
    error_j     = m_j - (decoded0_j + s_j)             the value ``transcoder.error``
    decoded_j   = decode_to(j, features_0..j)          (of the edited features)
    recon_j     = decoded_j + s_j                      the value ``transcoder.reconstruction``

and what reads ``m_j`` reads, with ``splice="error"`` (the default), ``m_j + (decoded_j - decoded0_j)``
where the features of some block i <= j can be edited (exactly ``m_j`` while they are not edited: the
two decodes agree bit for bit) and ``m_j`` itself otherwise; with ``splice="reconstruction"``,
``recon_j``. The encode and decode of each block are the CLT's own methods, called as submodules.
These are a per-layer splice's formulas (``rewrites.splice``, whose functions emit them here) with the
decode reading the features of every block before it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from .emit import emitter
from .on_request import Rewrite
from .splice import emit_features, emit_outputs, name_parts

aten = torch.ops.aten


class BlockCall(torch.nn.Module):
    """One method of a cross-layer transcoder for one block, as a module of its own: ``encode`` and
    ``skip`` read the block's input; ``decode_to`` reads the features of blocks 0..block, one argument each."""

    def __init__(self, owner: torch.nn.Module, method: str, block: int):
        super().__init__()
        self.owner, self.method, self.block = owner, method, block

    def forward(self, *args):
        if self.method == "decode_to":
            return self.owner.decode_to(self.block, list(args))
        return getattr(self.owner, self.method)(self.block, *args)


@dataclass(frozen=True, eq=False)
class SpliceCLT(Rewrite):
    """Splice ``clt`` across every block: block i reads ``sources[i]`` and stands in for the MLP
    output ``outputs[i]``. One rewrite serves every block's values."""

    clt: torch.nn.Module
    sources: tuple[Node, ...]
    outputs: tuple[Node, ...]
    splice: str = "error"
    note: str = Rewrite.note

    def apply(self, program, node: Node, name: str, option: dict) -> None:
        graph, module, clt = program.graph, program.module, self.clt
        edited = [f"layers.{i}.transcoder.features" in program.slots for i in range(len(self.outputs))]
        original, features = [], []
        for j, (x, m) in enumerate(zip(self.sources, self.outputs)):
            stem = f"clt__layers_{j}__"
            for method in ("encode", "decode_to") + (("skip",) if clt.W_skip is not None else ()):
                module.add_submodule(stem + method, BlockCall(clt, method, j))
            readers, emit = list(m.users), emitter(graph, m)
            with graph.inserting_before(m.next):  # after block j's MLP output (x_j and blocks i < j before it)
                original.append(emit_features(graph, emit, m, stem, x, clt)[0])
                features.append(emit(aten.alias.default, original[-1]))
                parts, out = emit_outputs(graph, emit, m, stem + "decode_to", tuple(original), tuple(features),
                                          stem + "skip" if clt.W_skip is not None else None, x, any(edited[:j + 1]),
                                          self.splice)
                named = name_parts(emit, (f"layers.{j}.transcoder",), {"features": features[-1], **parts})
            for reader in readers:
                reader.replace_input_with(m, out)
            program.spliced.update(named)
