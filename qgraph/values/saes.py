"""The values of the SAEs an instrumented model splices in: ``<host>.sae.features``, ``.reconstruction``,
``.error`` and, for a TopK SAE, the sparse ``.activations`` and ``.indices`` for an SAE at ``<host>.<value>`` (``layers.5.sae.features`` for ``layers.5.layer_output``).

Each is made on request (``passes.sae.SpliceSAE``): asking for any of them, or editing the features,
splices that SAE into the program; once spliced they are found at the nodes the splice made.
"""
from __future__ import annotations

from ..families.rules import SAEPart, ValueSpec
from ..passes.locate import Found, Missing, OnRequest
from ..passes.sae import SpliceSAE
from .catalogue import Entry

PARTS = {
    "features": ("Features [batch seq d_sae]", "The SAE's feature activations of the value (edit them here)"),
    "reconstruction": (None, "The SAE's decoding of its features, as edited"),
    "error": (None, "The value minus the SAE's reconstruction of it (of the unedited features); read-only"),
    "activations": ("Features [batch seq k]", "A TopK SAE's k feature activations per token, largest first (the "
                                              "sparse form of its features, as edited); read-only"),
    "indices": ("Features [batch seq k]", "Which features those activations are (int32); read-only"),
}
SPARSE = ("activations", "indices")


def prefix_of(hook: str) -> str:
    """Where an SAE's values live: the hook value's host (``layers.5.layer_output`` -> ``layers.5``)."""
    return hook.rpartition(".")[0]


def sae_entries(catalogue: dict[str, Entry], saes: dict, spliced: dict) -> dict[str, Entry]:
    """The entries of the SAEs in ``saes`` (``{hook: (sae, splice)}``), found where ``spliced`` (the
    program's record of the splices made) has them, else made on request at the hook's node."""
    entries = {}
    for hook, (sae, splice) in saes.items():
        prefix, host = prefix_of(hook), catalogue[hook]
        for part, (layout, description) in PARTS.items():
            layout = layout or host.layout
            widths = {"features": sae.d_sae, "activations": sae.k, "indices": sae.k}
            shape = (*host.shape[:-1], widths.get(part, host.shape[-1]))
            if part in SPARSE and sae.k is None:
                location = Missing(f"the sparse form is a TopK SAE's (k features per token); the SAE at '{hook}' is "
                                   f"{sae.activation}: read '{prefix}.sae.features'")
            elif prefix in spliced:
                location = Found(spliced[prefix][part])
            elif isinstance(host.location, Found) and not host.location.view:
                location = OnRequest(host.location.node, SpliceSAE(sae, hook, prefix, splice))
            else:
                location = Missing(f"an SAE splices at a value found as a node without a view; '{hook}' is not")
            name = f"{prefix}.sae.{part}"
            spec = ValueSpec(f"sae.{part}", "sae", layout, description, SAEPart(part))
            entries[name] = Entry(name, prefix, layout, shape, description, location, spec)
    return entries
