"""The values of the dictionaries an instrumented model splices in (SAEs, per-layer transcoders, a
cross-layer transcoder's blocks), one set per dictionary: its ``features``, ``reconstruction``,
``error`` and, for a TopK one, the sparse ``activations`` and ``indices``. The kinds differ by data
(``Kind``: the word of their names, the words of their descriptions), not by code.

- An SAE's are named after the value it reads: ``<hook>.sae.*`` (``layers.5.layer_output.sae.features``
  for an SAE at ``layers.5.layer_output``). Where no other SAE reads a value of the same host, the short
  names ``<host>.sae.*`` name the same values (``layers.5.sae.features``); where several do (SAEs at a
  block's input and output), the short names are refused with the long ones to write instead.
- A transcoder's, across block i's MLP, are ``layers.{i}.transcoder.*``; so are a cross-layer
  transcoder's block i's (``saes.clt.CLTBlock``).

Each is made on request (``rewrites.splice.SpliceDictionary``): asking for any of them, or editing the
features, splices that dictionary into the program; once spliced they are found at the nodes the
splice made. A cross-layer transcoder's blocks share one rewrite (``rewrites.clt.SpliceCLT``): asking for
any block's value splices every block.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from ..families.rules import SAEPart, ValueSpec
from ..rewrites.clt import SpliceCLT
from .locate import Found, Located, Missing, OnRequest
from ..rewrites.splice import SpliceDictionary
from .catalogue import Entry

# each part's layout (None: that of the value the dictionary stands in for) and description, in its kind's words
PARTS = {
    "features": ("Features [batch seq d_sae]", "The {kind}'s feature activations of {reads} (edit them here)"),
    "reconstruction": (None, "The {kind}'s {output}"),
    "error": (None, "{target} minus the {kind}'s {unedited}; read-only"),
    "activations": ("Features [batch seq k]", ("A TopK {kind}'s k feature activations per token: the features, as "
                                               "edited, that its encoder selected, largest pre-activation first "
                                               "(the sparse form); read-only")),
    "indices": ("Features [batch seq k]", "Which features its encoder selected (int32); read-only"),
}
SPARSE = ("activations", "indices")


@dataclass(frozen=True)
class Kind:
    """A kind of dictionary, as its values name and describe it."""

    tag: str  # the word of its values' names and specs: "<hook>.sae.features", "layers.3.transcoder.features"
    word: str  # what the reason its sparse form is missing calls it: "a TopK SAE's"
    words: dict  # the words of PARTS' descriptions
    note: str  # what asking for one of its values does (its rewrite's note)


SAE = Kind("sae", "SAE", {"kind": "SAE", "reads": "the value", "output": "decoding of its features, as edited",
                          "target": "The value", "unedited": "reconstruction of it (of the unedited features)"},
           "asking for it splices the SAE at its value (encode, decode, error)")
TRANSCODER = Kind("transcoder", "transcoder", {
    "kind": "transcoder", "reads": "the block's MLP input",
    "output": "output: the decoding of its features, as edited, plus its skip path",
    "target": "The MLP's output", "unedited": "output of the unedited features"},
    "asking for it splices the transcoder across the block's MLP (encode its input, decode, error at its output)")
CLT = Kind("transcoder", "transcoder", {
    **TRANSCODER.words, "kind": "cross-layer transcoder",
    "output": "output at this block: what the features of this block and of every block before it, as edited, "
              "decode to here (plus b_dec and its skip path)"},
    "asking for it splices the cross-layer transcoder across every block's MLP (encode each block's input, decode "
    "to it and every later block, error at each output)")


def host_of(hook: str) -> str:
    """The host of the value an SAE reads (``layers.5.layer_output`` -> ``layers.5``): its short names'."""
    return hook.rpartition(".")[0]


def prefixes(saes) -> dict[str, tuple[str, ...]]:
    """``{hook: the prefixes of its values}``: its own, and its host's where no other SAE of ``saes``
    reads a value of that host (``layers.5.layer_output`` and ``layers.5`` for one SAE at block 5)."""
    hosts = Counter(host_of(hook) for hook in saes)
    return {hook: (hook, host_of(hook)) if host_of(hook) and hosts[host_of(hook)] == 1 else (hook,)
            for hook in saes}


def inputs(layer: int, transcoder) -> tuple[str, str]:
    """The values a block's transcoder reads and writes (``layers.1.mlp_input``, ``layers.1.mlp.mlp_output``)."""
    return f"layers.{layer}.{transcoder.reads}", f"layers.{layer}.{transcoder.writes}"


def dictionary_entries(catalogue: dict[str, Entry], saes: dict, transcoders: dict, spliced: dict) -> dict[str, Entry]:
    """The entries of the SAEs in ``saes`` (``{hook: (sae, splice)}``) and the transcoders in
    ``transcoders`` (``{block: (transcoder, splice)}``, checked by ``saes.splice``), found where
    ``spliced`` (the program's record of the values the splices made: ``{value name: node}``) has
    them, else made on request at the node of the value each stands in for."""
    entries = {}
    for hook, (sae, splice) in saes.items():
        entries.update(_sae_entries(catalogue, saes, hook, sae, splice, spliced))
    shared: dict[int, OnRequest] = {}  # {id(clt): its one rewrite}
    for layer, (tc, splice) in transcoders.items():  # what each reads and writes is found (saes.splice checked)
        read, written = inputs(layer, tc)
        host, clt, prefix = catalogue[written], getattr(tc, "clt", None), f"layers.{layer}.{TRANSCODER.tag}"
        if clt is None:
            kind, what = TRANSCODER, tc.activation
            made = OnRequest(host.found.node, _splice(TRANSCODER, tc, f"layers.{layer}", (prefix,),
                                                      catalogue[read].found.node, splice))
        else:  # one rewrite at the last block's MLP output splices every block of the CLT
            kind, what = CLT, "a cross-layer transcoder"
            if id(clt) not in shared:
                blocks = sorted(block for block, (other, _) in transcoders.items()
                                if getattr(other, "clt", None) is clt)
                sides = [[catalogue[name].found.node for name in inputs(block, transcoders[block][0])]
                         for block in blocks]
                shared[id(clt)] = OnRequest(sides[-1][1], SpliceCLT(clt, tuple(x for x, _ in sides),
                                                                    tuple(m for _, m in sides), splice, CLT.note))
            made = shared[id(clt)]
        entries.update(_entries(kind, tc, host, f"layers.{layer}", (prefix,), made,
                                f"the one at block {layer} is {what}", spliced))
    return entries


def _sae_entries(catalogue: dict[str, Entry], saes: dict, hook: str, sae, splice: str, spliced: dict) -> dict:
    """The entries of the SAE at ``hook``, made on request where its value is a node without a view;
    a short name several SAEs of ``saes`` would share is missing, with the names to write instead."""
    host, names = catalogue[hook], tuple(f"{prefix}.{SAE.tag}" for prefix in prefixes(saes)[hook])
    made: OnRequest | Missing
    if isinstance(host.location, Found) and not host.location.view:
        made = OnRequest(host.location.node, _splice(SAE, sae, hook, names, None, splice))
    else:
        made = Missing(f"an SAE splices at a value found as a node without a view; '{hook}' is not")
    entries = _entries(SAE, sae, host, host_of(hook), names, made, f"the SAE at '{hook}' is {sae.activation}",
                       spliced)
    sharing = sorted(other for other in saes if host_of(other) == host_of(hook))
    if len(sharing) > 1 and host_of(hook):  # the short names are no one's
        for part in PARTS:
            short = f"{host_of(hook)}.{SAE.tag}.{part}"
            entries[short] = dataclasses.replace(entries[f"{hook}.{SAE.tag}.{part}"], name=short, location=Missing(
                f"SAEs read {len(sharing)} values of '{host_of(hook)}' ({', '.join(sharing)}): name one, "
                f"e.g. '{sharing[0]}.{SAE.tag}.{part}'"))
    return entries


def _splice(kind: Kind, dictionary, at: str, names: tuple[str, ...], source, splice: str) -> SpliceDictionary:
    """The rewrite that splices ``dictionary`` at the value ``at`` (an SAE's hook, ``layers.{i}`` for a
    transcoder), its submodules named after it: ``sae__layers_5_layer_output__encode``."""
    return SpliceDictionary(dictionary, names, f"{kind.tag}__{at.replace('.', '_')}__", source, splice, kind.note)


def _entries(kind: Kind, dictionary, host: Entry, block: str, names: tuple[str, ...], made: OnRequest | Missing,
             which: str, spliced: dict) -> dict[str, Entry]:
    """The entries of one dictionary of ``kind`` on ``block``, standing in for the value ``host`` (its
    layout, its shape), named ``<name>.<part>`` for each of ``names``: found in ``spliced``, else
    ``made`` (``OnRequest`` or ``Missing``); ``which`` says, where the sparse form is missing, what the
    dictionary is instead of TopK."""
    entries = {}
    widths = {"features": dictionary.d_sae, "activations": dictionary.k, "indices": dictionary.k}
    for part, (layout, description) in PARTS.items():
        layout, description = layout or host.layout, description.format(**kind.words)
        shape = (*host.shape[:-1], widths.get(part, host.shape[-1]))
        spec = ValueSpec(f"{kind.tag}.{part}", kind.tag, layout, description, SAEPart(part))
        for prefix in names:
            name = f"{prefix}.{part}"
            where: Located
            if part in SPARSE and dictionary.k is None:
                where = Missing(f"the sparse form is a TopK {kind.word}'s (k features per token); {which}: read "
                                f"'{prefix}.features'")
            else:
                where = Found(spliced[name]) if name in spliced else made
            entries[name] = Entry(name, block, layout, shape, description, where, spec)
    return entries
