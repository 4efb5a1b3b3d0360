"""Checking ``instrument(model, saes={value: sae}, splice=...)``: which value each SAE reads, and that
it fits there. The splice itself is a rewrite (``rewrites.splice.SpliceDictionary``); its values are
catalogued by ``values.dictionaries``. Likewise ``instrument(model, transcoders={block: transcoder})``:
``check_transcoders``, the same rewrite and catalogue (and ``transcoders=clt``, a cross-layer
transcoder: ``rewrites.clt.SpliceCLT``)."""
from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import InvalidArgument, InvalidType, NotSupported, OutOfRange
from ..values.locate import Found
from ..rewrites.splice import SPLICES
from .clt import CrossLayerTranscoder
from .transcoder import Transcoder


def check_saes(request, resolve, catalogue) -> dict:
    """``{hook value: (sae, splice)}`` for ``request = (saes, splice)``; a named error for a key that
    is not one value, an object that is not an SAE, an SAE whose width is not the value's, or a
    second SAE at a tensor one already reads (two names of one node: ``mlp.mlp_output`` and the
    ``mlp.output`` port)."""
    saes, splice = request
    if splice not in SPLICES:
        raise InvalidArgument(f"splice={splice!r}: give 'error' (the model reads its own value; the SAE's error term "
                              f"is kept) or 'reconstruction' (the model reads the SAE's reconstruction)")
    if not isinstance(saes, Mapping):
        raise InvalidType(f"saes= takes a dict {{value name: SAE}}, e.g. {{'layers.5.layer_output': "
                          f"qgraph.SAE.load(path, layer=5)}}, not {type(saes).__name__}")
    checked: dict[str, tuple[object, str]] = {}  # hook value -> (sae, splice)
    for pattern, sae in saes.items():
        names = resolve(pattern)
        if len(names) != 1:
            raise InvalidArgument(f"saes: '{pattern}' selects {len(names)} values ({names[:4]}...); give each SAE "
                                  f"the one value it reads, e.g. 'layers.5.layer_output'")
        hook = names[0]
        if getattr(sae, "decodes_input", True) is False:  # a Transcoder: it reads one value and writes another
            raise InvalidType(f"saes['{hook}'] is a transcoder ({sae.source}): splice it across a block's MLP with "
                              f"transcoders={{block: transcoder}}")
        if not all(hasattr(sae, attribute) for attribute in ("encode", "decode", "d_in", "d_sae")):
            raise InvalidType(f"saes['{hook}'] is a {type(sae).__name__}, not an SAE: load one with "
                              f"qgraph.SAE.load(path, layer=...)")
        if getattr(sae, "hook", None) and sae.hook != hook:
            raise InvalidArgument(f"saes['{hook}']: {getattr(sae, 'source', 'the SAE')} was trained on "
                                  f"'{sae.hook}', not '{hook}': splice it at '{sae.hook}', or load it with "
                                  f"SAE.load(path, hook='{hook}') if you mean to")
        width = catalogue[hook].shape[-1]
        if sae.d_in != width:
            raise InvalidArgument(f"saes['{hook}']: the SAE reads vectors of {sae.d_in} but '{hook}' has "
                                  f"{width} ({catalogue[hook].layout}): load the SAE trained on this model and value")
        node = getattr(catalogue[hook].location, "node", None)
        same = [other for other in checked if node is not None
                and node is getattr(catalogue[other].location, "node", None)]
        if same:
            raise InvalidArgument(f"saes: '{same[0]}' and '{hook}' are one tensor of the program: splice one SAE there "
                                  f"(SAEs at different values of a block, its layer_input and layer_output say, "
                                  f"each splice)")
        checked[hook] = (sae, splice)
    return checked


def check_transcoders(request, catalogue, saes: dict) -> dict:
    """``{block: (transcoder, splice)}`` for ``request = (transcoders, splice)`` (``splice`` checked with
    the SAEs'); a named error for a key that is not a block of the model, an object that is not a
    ``Transcoder``, one trained on another block, one whose widths are not the model's, or an SAE
    (``saes``, checked) at the tensor a transcoder reads or writes. A ``CrossLayerTranscoder`` instead
    of the dict splices across every block: ``{block: (its CLTBlock, splice)}`` for all of them, once
    its count of blocks is checked against the model's."""
    transcoders, splice = request
    blocks = sum(1 for name in catalogue if re.fullmatch(r"layers\.\d+\.layer_output", name))
    if isinstance(transcoders, CrossLayerTranscoder):
        if transcoders.n_layers != blocks:
            raise InvalidArgument(f"transcoders: {transcoders.source} has {transcoders.n_layers} blocks, but the model "
                                  f"has {blocks}: load the cross-layer transcoder trained on this model")
        return {block: (_check_block(block, transcoders.block(block), catalogue, saes), splice)
                for block in range(blocks)}
    if not isinstance(transcoders, Mapping):
        raise InvalidType(f"transcoders= takes a dict {{block: Transcoder}}, e.g. {{3: qgraph.Transcoder.load(path, "
                          f"layer=3)}}, or a qgraph.CrossLayerTranscoder, not {type(transcoders).__name__}")
    checked = {}
    for block, tc in transcoders.items():
        if not isinstance(block, int) or isinstance(block, bool) or not -blocks <= block < blocks:
            raise OutOfRange(f"transcoders: block {block!r}: the model has blocks 0 to {blocks - 1}")
        block %= blocks
        if isinstance(tc, CrossLayerTranscoder):
            raise InvalidType(f"transcoders[{block}] is a cross-layer transcoder: it spans every block, so give it "
                              f"alone, transcoders=clt")
        if not isinstance(tc, Transcoder):
            raise InvalidType(f"transcoders[{block}] is a {type(tc).__name__}, not a Transcoder: load one with "
                              f"qgraph.Transcoder.load(path, layer={block})")
        if block in checked:
            raise InvalidArgument(f"transcoders: two transcoders at block {block}")
        if tc.layer is not None and tc.layer != block:
            raise InvalidArgument(f"transcoders[{block}]: {tc.source} is the transcoder of block {tc.layer}: splice it "
                                  f"at block {tc.layer}")
        checked[block] = (_check_block(block, tc, catalogue, saes), splice)
    return checked


def _check_block(block: int, tc, catalogue, saes: dict):
    """``tc`` (a block's transcoder, or a CLT's block), once the values it reads and writes are nodes
    of the program as wide as it, with no SAE (``saes``) at either."""
    from ..values.dictionaries import inputs  # lazy: keeps sympy out until this is used
    for name, width, what in zip(inputs(block, tc), (tc.d_in, tc.d_out), ("reads", "writes")):
        entry = catalogue.get(name)
        location = entry.location if entry is not None else None
        if not isinstance(location, Found) or location.view:
            raise NotSupported(f"transcoders[{block}]: the transcoder {what} '{name}', which this model's program "
                               f"does not hold as a node" + (f" ({entry.reason})" if entry and entry.reason else ""))
        if entry.shape[-1] != width:
            raise InvalidArgument(f"transcoders[{block}]: {tc.source} {what} vectors of {width}, but '{name}' has "
                                  f"{entry.shape[-1]} (the model's d_model): load the transcoder trained on this model")
        shared = [hook for hook in saes if getattr(catalogue[hook].location, "node", None) is location.node]
        if shared:
            raise InvalidArgument(f"transcoders[{block}] {what} '{name}', the tensor the SAE at '{shared[0]}' reads: "
                                  f"splice one of them there")
    return tc
