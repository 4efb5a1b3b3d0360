"""The values of the per-layer transcoders an instrumented model splices in, one set per block:
``layers.{i}.transcoder.features``, ``.reconstruction``, ``.error`` and, for a TopK transcoder, the
sparse ``.activations`` and ``.indices``.

Each is made on request (``passes.transcoder.SpliceTranscoder``): asking for any of them, or editing
the features, splices that block's transcoder into the program; once spliced they are found at the
nodes the splice made. A cross-layer transcoder's blocks (``saes.clt.CLTBlock``) share one rewrite
(``passes.clt.SpliceCLT``): asking for any block's value splices every block.
"""
from __future__ import annotations

from ..families.rules import SAEPart, ValueSpec
from ..passes.locate import Found, Missing, OnRequest
from ..passes.clt import SpliceCLT
from ..passes.transcoder import SpliceTranscoder
from .catalogue import Entry

PARTS = {
    "features": ("Features [batch seq d_sae]", "The transcoder's feature activations of the block's MLP input "
                                               "(edit them here)"),
    "reconstruction": (None, "The transcoder's output: the decoding of its features, as edited, plus its skip path"),
    "error": (None, "The MLP's output minus the transcoder's output of the unedited features; read-only"),
    "activations": ("Features [batch seq k]", "A TopK transcoder's k feature activations per token: the features, "
                                              "as edited, that its encoder selected, largest pre-activation first "
                                              "(the sparse form); read-only"),
    "indices": ("Features [batch seq k]", "Which features its encoder selected (int32); read-only"),
}
SPARSE = ("activations", "indices")
# a cross-layer transcoder's reconstruction: every decoder that writes the block
CLT_RECONSTRUCTION = ("The cross-layer transcoder's output at this block: what the features of this block and of every "
                      "block before it, as edited, decode to here (plus b_dec and its skip path)")


def inputs(layer: int, transcoder) -> tuple[str, str]:
    """The values a block's transcoder reads and writes (``layers.1.mlp_input``, ``layers.1.mlp.mlp_output``)."""
    return f"layers.{layer}.{transcoder.reads}", f"layers.{layer}.{transcoder.writes}"


def transcoder_entries(catalogue: dict[str, Entry], transcoders: dict, spliced: dict) -> dict[str, Entry]:
    """The entries of the transcoders in ``transcoders`` (``{block: (transcoder, splice)}``, checked by
    ``saes.splice.check_transcoders``), found where ``spliced`` (the program's record of the splices
    made: ``{"layers.{i}.transcoder": {value name: node}}``) has them, else made on request at the MLP
    output's node."""
    entries, shared = {}, {}
    for layer, (tc, splice) in transcoders.items():
        prefix, (read, written) = f"layers.{layer}.transcoder", inputs(layer, tc)
        host, clt = catalogue[written], getattr(tc, "clt", None)
        if clt is None:
            node, rewrite = host.location.node, SpliceTranscoder(tc, layer, catalogue[read].location.node, splice)
        else:  # one rewrite at the last block's MLP output splices every block of the CLT
            if id(clt) not in shared:
                blocks = sorted(block for block, (other, _) in transcoders.items() if getattr(other, "clt", None) is clt)
                sides = [[catalogue[name].location.node for name in inputs(block, transcoders[block][0])]
                         for block in blocks]
                shared[id(clt)] = (sides[-1][1], SpliceCLT(clt, tuple(x for x, _ in sides), tuple(m for _, m in sides),
                                                           splice))
            node, rewrite = shared[id(clt)]
        for part, (layout, description) in PARTS.items():
            name = f"{prefix}.{part}"
            if clt is not None and part == "reconstruction":
                description = CLT_RECONSTRUCTION
            if part in SPARSE and tc.k is None:
                location = Missing(f"the sparse form is a TopK transcoder's (k features per token); the one at block "
                                   f"{layer} is {'a cross-layer transcoder' if clt is not None else tc.activation}: "
                                   f"read '{prefix}.features'")
            elif prefix in spliced:
                location = Found(spliced[prefix][name])
            else:
                location = OnRequest(node, rewrite)
            layout = layout or host.layout
            widths = {"features": tc.d_sae, "activations": tc.k, "indices": tc.k}
            shape = (*host.shape[:-1], widths.get(part, host.shape[-1]))
            spec = ValueSpec(f"transcoder.{part}", "transcoder", layout, description, SAEPart(part))
            entries[name] = Entry(name, f"layers.{layer}", layout, shape, description, location, spec)
    return entries
