"""The transcoders of a replacement model as attribution reads them: per-layer transcoders
(``{block: qgraph.Transcoder}``, every block) or one cross-layer transcoder (``qgraph.CrossLayerTranscoder``),
behind one interface: what each block's features read, their encoders, and the decoders by which
they write the MLP outputs of their block (per-layer) or of it and every later block (cross-layer).

As in circuit-tracer, a cross-layer feature's direct effect on a target sums its decoders into every
block before the target reads: ``activation * sum over j >= i of gradient_at_output_j . W_dec[i][f, j - i]``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InvalidArgument
from ..inputs import input_embedding
from ..saes.transcoder import Transcoder
from ..saes.clt import CrossLayerTranscoder


class TranscoderSet:
    """``spliced``: what ``passes.replacement`` splices (the dict, or the cross-layer transcoder);
    ``cross``: a cross-layer transcoder's; ``reads[i]``: the value block i's features read
    (``mlp_input`` or ``layer_mid``)."""

    def __init__(self, spliced, blocks: int):
        self.spliced, self.blocks = spliced, blocks
        self.cross = not isinstance(spliced, dict)
        self.reads = [spliced.reads] * blocks if self.cross else [spliced[i].reads for i in range(blocks)]
        self._constants: dict[int, torch.Tensor] = {}

    def encoder(self, block: int) -> torch.Tensor:
        """Block ``block``'s encoder ``[d_model, d_transcoder]`` (a feature's pre-activation is
        ``x @ W[:, f] + constant``)."""
        return self.spliced.W_enc[block] if self.cross else self.spliced[block].W_enc

    def encoder_constants(self, block: int) -> torch.Tensor:
        """The part of each feature's pre-activation no input accounts for: its pre-activation at 0."""
        if block not in self._constants:
            encoder = self.encoder(block)
            zero = torch.zeros(1, encoder.shape[0], dtype=encoder.dtype, device=encoder.device)
            pre = self.spliced.pre(block, zero) if self.cross else self.spliced[block].pre(zero)
            self._constants[block] = pre[0].detach().float().cpu()
        return self._constants[block]

    def decoders(self, block: int, features: torch.Tensor):
        """``(j, [n, d_model])`` for each block j that block ``block``'s ``features`` write: their
        decoders there (one block's at a time: a cross-layer set's whole rows would be blocks times larger)."""
        if not self.cross:
            yield block, self.spliced[block].W_dec[features].float()
            return
        for j in range(block, self.blocks):
            yield j, self.spliced.W_dec[block][features, j - block].float()

    def output_bias(self, block: int) -> torch.Tensor:
        """``b_dec`` of block ``block``: added once to its reconstruction."""
        return (self.spliced.b_dec[block] if self.cross else self.spliced[block].b_dec).float()

    def parameters(self):
        return list(self.spliced.parameters()) if self.cross else \
            [p for tc in self.spliced.values() for p in tc.parameters()]


def loaded(transcoders, blocks: int):
    """A folder's transcoders: a cross-layer one (``W_enc_{i}.safetensors`` or ``params_layer_{i}.safetensors``
    in it) or ``{block: Transcoder}`` for blocks 0..``blocks - 1``; anything else as given."""
    if not isinstance(transcoders, (str, Path)):
        return transcoders
    folder = Path(transcoders)
    folder = folder.parent if folder.is_file() else folder
    if any(folder.glob("W_enc_*.safetensors")) or any(folder.glob("params_layer_*.safetensors")):
        return CrossLayerTranscoder.load(folder)
    return {i: Transcoder.load(transcoders, layer=i) for i in range(blocks)}


def transcoder_set(transcoders, blocks: int, model) -> TranscoderSet:
    """Per-layer transcoders for every block, a cross-layer transcoder, or a folder of either (a
    cross-layer one holds ``W_enc_{i}.safetensors`` or ``params_layer_{i}.safetensors``), checked against the model."""
    width = input_embedding(model).embedding_dim
    transcoders = loaded(transcoders, blocks)
    if isinstance(transcoders, CrossLayerTranscoder):
        if transcoders.n_layers != blocks or transcoders.d_model != width:
            raise InvalidArgument(f"{transcoders.source} covers {transcoders.n_layers} blocks of a "
                                  f"{transcoders.d_model} wide stream; the model has {blocks} blocks of {width}: give "
                                  f"the model's own cross-layer transcoder")
        return TranscoderSet(transcoders, blocks)
    if not isinstance(transcoders, dict):
        raise InvalidArgument(f"transcoders takes {{block: qgraph.Transcoder}} for every block, a "
                              f"qgraph.CrossLayerTranscoder or a folder of either, not {type(transcoders).__name__}")
    missing = sorted(set(range(blocks)) - set(transcoders))
    if missing:
        raise InvalidArgument(f"the replacement model needs a transcoder at every block; blocks {missing} have "
                              f"none (give transcoders={{block: Transcoder}} for blocks 0 to {blocks - 1})")
    for block, transcoder in transcoders.items():
        if not isinstance(block, int) or not 0 <= block < blocks:
            raise InvalidArgument(f"a transcoder at block {block!r}: the model has blocks 0 to {blocks - 1}")
        if transcoder.W_enc.shape[0] != width or transcoder.W_dec.shape[1] != width:
            raise InvalidArgument(f"the transcoder at block {block} reads {transcoder.W_enc.shape[0]} and writes "
                                  f"{transcoder.W_dec.shape[1]} wide vectors; the model's stream is {width} wide")
    return TranscoderSet(dict(sorted(transcoders.items())), blocks)
