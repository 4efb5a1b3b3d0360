"""The values of the SAEs an instrumented model splices in, named after the value each SAE reads:
``<hook>.sae.features``, ``.reconstruction``, ``.error`` and, for a TopK SAE, the sparse
``.activations`` and ``.indices`` (``layers.5.layer_output.sae.features`` for an SAE at
``layers.5.layer_output``). Where no other SAE reads a value of the same host, the short names
``<host>.sae.*`` name the same values (``layers.5.sae.features``); where several do (SAEs at a block's
input and output), the short names are refused with the long ones to write instead.

Each is made on request (``passes.sae.SpliceSAE``): asking for any of them, or editing the features,
splices that SAE into the program; once spliced they are found at the nodes the splice made.
"""
from __future__ import annotations

from collections import Counter

from ..families.rules import SAEPart, ValueSpec
from ..passes.locate import Found, Missing, OnRequest
from ..passes.sae import SpliceSAE
from .catalogue import Entry

PARTS = {
    "features": ("Features [batch seq d_sae]", "The SAE's feature activations of the value (edit them here)"),
    "reconstruction": (None, "The SAE's decoding of its features, as edited"),
    "error": (None, "The value minus the SAE's reconstruction of it (of the unedited features); read-only"),
    "activations": ("Features [batch seq k]", "A TopK SAE's k feature activations per token: the features, as "
                                              "edited, that its encoder selected, largest pre-activation first "
                                              "(the sparse form); read-only"),
    "indices": ("Features [batch seq k]", "Which features its encoder selected (int32); read-only"),
}
SPARSE = ("activations", "indices")


def host_of(hook: str) -> str:
    """The host of the value an SAE reads (``layers.5.layer_output`` -> ``layers.5``): its short names'."""
    return hook.rpartition(".")[0]


def prefixes(saes) -> dict[str, tuple[str, ...]]:
    """``{hook: the prefixes of its values}``: its own, and its host's where no other SAE of ``saes``
    reads a value of that host (``layers.5.layer_output`` and ``layers.5`` for one SAE at block 5)."""
    hosts = Counter(host_of(hook) for hook in saes)
    return {hook: (hook, host_of(hook)) if host_of(hook) and hosts[host_of(hook)] == 1 else (hook,)
            for hook in saes}


def sae_entries(catalogue: dict[str, Entry], saes: dict, spliced: dict) -> dict[str, Entry]:
    """The entries of the SAEs in ``saes`` (``{hook: (sae, splice)}``), found where ``spliced`` (the
    program's record of the splices made: ``{hook: {value name: node}}``) has them, else made on
    request at the hook's node; a short name several SAEs would share is missing, with the names to
    write instead."""
    entries, names = {}, prefixes(saes)
    for hook, (sae, splice) in saes.items():
        host, rewrite = catalogue[hook], SpliceSAE(sae, hook, names[hook], splice)

        def location(prefix: str, part: str):
            if part in SPARSE and sae.k is None:
                return Missing(f"the sparse form is a TopK SAE's (k features per token); the SAE at '{hook}' is "
                               f"{sae.activation}: read '{prefix}.sae.features'")
            if hook in spliced:
                return Found(spliced[hook][f"{prefix}.sae.{part}"])
            if isinstance(host.location, Found) and not host.location.view:
                return OnRequest(host.location.node, rewrite)
            return Missing(f"an SAE splices at a value found as a node without a view; '{hook}' is not")

        sharing = sorted(other for other in saes if host_of(other) == host_of(hook))
        for part, (layout, description) in PARTS.items():
            layout = layout or host.layout
            widths = {"features": sae.d_sae, "activations": sae.k, "indices": sae.k}
            shape = (*host.shape[:-1], widths.get(part, host.shape[-1]))
            named = {f"{prefix}.sae.{part}": location(prefix, part) for prefix in names[hook]}
            if len(sharing) > 1 and host_of(hook):  # the short name is no one's
                named[f"{host_of(hook)}.sae.{part}"] = Missing(
                    f"SAEs read {len(sharing)} values of '{host_of(hook)}' ({', '.join(sharing)}): name one, "
                    f"e.g. '{sharing[0]}.sae.{part}'")
            spec = ValueSpec(f"sae.{part}", "sae", layout, description, SAEPart(part))
            for name, where in named.items():
                entries[name] = Entry(name, host_of(hook), layout, shape, description, where, spec)
    return entries
