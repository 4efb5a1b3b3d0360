"""Checking ``instrument(model, saes={value: sae}, splice=...)``: which value each SAE reads, and that
it fits there. The splice itself is a rewrite (``passes.sae.SpliceSAE``); its values are catalogued
by ``values.saes``."""
from __future__ import annotations

from collections.abc import Mapping

from ..errors import InvalidArgument, InvalidType
from ..passes.sae import SPLICES


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
    checked = {}
    for pattern, sae in saes.items():
        names = resolve(pattern)
        if len(names) != 1:
            raise InvalidArgument(f"saes: '{pattern}' selects {len(names)} values ({names[:4]}...); give each SAE the one "
                                  f"value it reads, e.g. 'layers.5.layer_output'")
        hook = names[0]
        if not all(hasattr(sae, attribute) for attribute in ("encode", "decode", "d_in", "d_sae")):
            raise InvalidType(f"saes['{hook}'] is a {type(sae).__name__}, not an SAE: load one with "
                              f"qgraph.SAE.load(path, layer=...)")
        if getattr(sae, "hook", None) and sae.hook != hook:
            raise InvalidArgument(f"saes['{hook}']: {getattr(sae, 'source', 'the SAE')} was trained on '{sae.hook}', not "
                                  f"'{hook}': splice it at '{sae.hook}', or load it with SAE.load(path, hook='{hook}') "
                                  f"if you mean to")
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
