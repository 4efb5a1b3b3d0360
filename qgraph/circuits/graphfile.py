"""circuit-tracer's graph files: an ``AttributionGraph`` written as its frontend's JSON, and read back from one.

The format is ``circuit_tracer/utils/create_graph_files.py`` with the pydantic models of
``circuit_tracer/frontend/graph_models.py`` (what Neuronpedia's viewer reads too): ``metadata`` (the prompt's
tokens, the transcoders' ``scan``, the node threshold), ``qParams`` (the viewer's state), ``nodes`` (each with
``node_id``, ``feature_type``, ``layer``, ``ctx_idx``, ``influence``, ``activation``, ``clerp``...) and
``links`` (``source``, ``target``, ``weight = adjacency[target, source]``).

A file read is untrusted input: its size and its counts are bounded before any work, every field is
checked (type, range, and that each id names one node), and a problem is an ``InvalidArgument`` naming
the file, the entry and the way out. The graph read back is pruned already (a file holds the kept nodes
and edges only); what a file does not hold (the nodes' inputs, the constants) is nan.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

import torch

from ..errors import InvalidArgument, MissingFile
from .nodes import FEATURE_TYPES, KINDS, Node

__all__ = ["MAX_BYTES", "MAX_LINKS", "MAX_NODES", "json_data", "read", "write"]

# bounds on a file read: a pruned graph of a 2B model is a few thousand nodes and some 100k links (10-50 MB);
# the adjacency is dense, nodes² float32 (10k nodes: 400 MB)
MAX_BYTES, MAX_NODES, MAX_LINKS = 256 * 2 ** 20, 10_000, 2_000_000

KIND_OF = {feature_type: kind for kind, feature_type in FEATURE_TYPES.items()}
KIND_OF["per layer transcoder"] = KIND_OF["transcoder"] = "feature"  # what other writers call a feature
_ID = re.compile(r"([0-9]{1,6})_([0-9]{1,18})_([0-9]{1,9})")  # "{layer}_{feature}_{position}", bounded as int64s are
_LOGIT_CLERP = re.compile(r'Output "(.*)" \(p=[^)]*\)', re.S)


# -- writing -------------------------------------------------------------------------------------------
def json_data(graph, slug: str, scan: str | Sequence[str] | None, prompt: str | None,
              labels: Mapping[tuple[int, int], str]) -> dict:
    """The file's content for ``graph`` (pruned): every field of circuit-tracer's models, in their order."""
    scan = graph.scan if scan is None else scan
    transcoders: list[str] = []
    if scan is None:
        scan = "qgraph"
    elif not isinstance(scan, str):  # a list of transcoders: circuit-tracer names it "custom-<hash>"
        transcoders = list(scan)
        digest = hashlib.sha256("-".join(transcoders).encode()).digest()  # stable, unlike Python's hash()
        scan = f"custom-{int.from_bytes(digest[:8], 'big') >> 1}"
    tokens = graph.tokens or [str(t) for t in graph.input_ids.tolist()]
    metadata = dict(slug=slug, scan=scan, transcoder_list=transcoders, prompt_tokens=tokens,
                    prompt=prompt if prompt is not None else graph.prompt if graph.prompt is not None
                    else "".join(tokens) if graph.tokens else "",
                    node_threshold=graph.pruned[0] if graph.pruned is not None else None, schema_version=1)
    qparams = dict(pinnedIds=[], supernodes=[], linkType="both", clickedId="", sg_pos="")
    labels = {**graph.labels, **labels}
    nodes = [_json_node(graph, i, labels) for i in range(len(graph.nodes))]
    ids = [node["node_id"] for node in nodes]
    if len(set(ids)) != len(ids):  # links name their nodes by id: two nodes of one id would merge
        raise InvalidArgument(f"nodes {sorted({i for i in ids if ids.count(i) > 1})[:5]} are in the graph "
                              f"more than once: build it with each (kind, layer, position, feature) once")
    targets, sources = graph.edge_mask.nonzero(as_tuple=True)
    weights = graph.adjacency[targets, sources].tolist()
    links = [dict(source=ids[s], target=ids[t], weight=w)
             for t, s, w in zip(targets.tolist(), sources.tolist(), weights)]
    return dict(metadata=metadata, qParams=qparams, nodes=nodes, links=links)


def _json_node(graph, i: int, labels: Mapping) -> dict:
    """Node ``i`` as circuit-tracer's frontend ``Node`` (every field, in its order)."""
    node = graph.nodes[i]
    entry = dict(node_id=node.node_id, feature=-1, layer=str(node.layer), ctx_idx=node.position,
                 feature_type=FEATURE_TYPES[node.kind], token_prob=0.0, is_target_logit=False, run_idx=0,
                 reverse_ctx_idx=0, jsNodeId="", clerp="", influence=node.influence, activation=None)
    if node.kind == "feature":
        layer, feature = node.layer, node.feature
        entry.update(feature=(layer + feature) * (layer + feature + 1) // 2 + feature,
                     jsNodeId=f"{layer}_{feature}-0", clerp=labels.get((layer, feature), ""),
                     activation=node.activation)
    elif node.kind == "error":
        entry.update(jsNodeId=f"{node.layer}_{node.position}-0")
    elif node.kind == "embedding":
        entry.update(feature=node.position, layer="E", jsNodeId=f"E_{node.feature}-{node.position}")
    else:
        j = i - (len(graph.nodes) - graph.count("logit"))
        probability = float(graph.logit_probabilities[j])
        token = graph.logit_tokens[j] if graph.logit_tokens is not None else str(node.feature)
        entry.update(feature=node.feature, layer=str(node.layer + 1), token_prob=probability, is_target_logit=j == 0,
                     jsNodeId=f"L_{node.feature}-{node.position}", clerp=f'Output "{token}" (p={probability:.3f})',
                     influence=None)
    return entry


def write(data: dict, path: Path, slug: str) -> Path:
    """Write ``data`` to ``path`` (a ``.json`` file, or a folder: ``<slug>.json`` there, listed in the
    folder's ``graph-metadata.json`` as circuit-tracer's local server lists its graphs)."""
    folder = path.is_dir()
    target = path / f"{slug}.json" if folder else path
    if not folder and path.suffix.lower() != ".json":
        raise InvalidArgument(f"to_json writes a .json file or into a folder, not '{path.name}'")
    if not target.parent.is_dir():
        raise MissingFile(f"no folder {target.parent} to write {target.name} into")
    target.write_text(json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False), encoding="utf-8")
    if folder:
        listing = path / "graph-metadata.json"
        graphs = json.loads(listing.read_text(encoding="utf-8"))["graphs"] if listing.exists() else []
        graphs = [g for g in graphs if g.get("slug") != slug] + [data["metadata"]]
        listing.write_text(json.dumps({"graphs": graphs}, indent=2, ensure_ascii=False), encoding="utf-8")
    return target


# -- reading -------------------------------------------------------------------------------------------
class _Checked:
    """Reads one JSON object's fields, each checked, with errors naming the file and the entry."""

    def __init__(self, source: str, where: str, value):
        self.source, self.where = source, where
        if not isinstance(value, dict):
            self.fail(f"is {type(value).__name__}, not an object")
        self.value = value

    def fail(self, problem: str) -> NoReturn:
        raise InvalidArgument(f"{self.source}: {self.where} {problem} (not a circuit-tracer graph file, or a "
                              f"damaged one: write one with AttributionGraph.to_json or circuit-tracer's "
                              f"create_graph_files)")

    def get(self, key: str, kinds: tuple, default=None, required: bool = True):
        if key not in self.value:
            if required:
                self.fail(f"has no {key!r}")
            return default
        value = self.value[key]
        if isinstance(value, bool) and bool not in kinds:  # JSON's true is not a number
            self.fail(f"has {key!r} as a boolean")
        if not isinstance(value, kinds):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            self.fail(f"has {key!r} as {type(value).__name__}, not {names}")
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(f"has {key!r} not finite")
        return value

    def strings(self, key: str, limit: int) -> list[str]:
        values = self.get(key, (list,))
        if len(values) > limit:
            self.fail(f"has {len(values)} {key!r}, over the bound of {limit}")
        if not all(isinstance(v, str) for v in values):
            self.fail(f"has {key!r} that are not strings")
        return values


def _reject_constant(name: str):
    raise InvalidArgument(f"{name} is not a number JSON has")  # a ValueError: _parse names the file


def _parse(path: Path, max_bytes: int):
    if not path.is_file():
        raise MissingFile(f"no graph file {path}")
    size = path.stat().st_size
    if size > max_bytes:
        raise InvalidArgument(f"{path.name} is {size:,} bytes, over the bound of {max_bytes:,}: pass "
                              f"max_bytes= to read a larger graph")
    with path.open("rb") as file:
        raw = file.read(max_bytes + 1)
    if len(raw) > max_bytes:  # it grew since
        raise InvalidArgument(f"{path.name} is over the bound of {max_bytes:,} bytes: pass max_bytes=")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise InvalidArgument(f"{path.name} is not a JSON graph file: {error}") from None


def read(cls, path: str | Path, max_bytes: int = MAX_BYTES, max_nodes: int = MAX_NODES, max_links: int = MAX_LINKS):
    """The ``cls`` (``AttributionGraph``) a graph file holds; see ``AttributionGraph.from_json``."""
    path = Path(path)
    top = _Checked(path.name, "the file", _parse(path, max_bytes))
    metadata = _Checked(path.name, "metadata", top.get("metadata", (dict,)))
    tokens = metadata.strings("prompt_tokens", max_nodes)
    prompt = metadata.get("prompt", (str,), "", required=False)
    scan = metadata.get("scan", (str,), None, required=False)
    threshold = metadata.get("node_threshold", (int, float, type(None)), None, required=False)
    if "transcoder_list" in metadata.value:
        metadata.strings("transcoder_list", max_nodes)
    if "qParams" in top.value:
        _Checked(path.name, "qParams", top.value["qParams"])
    entries, links = top.get("nodes", (list,)), top.get("links", (list,))
    if len(entries) > max_nodes:
        top.fail(f"has {len(entries):,} nodes, over the bound of {max_nodes:,}: pass max_nodes= to read it "
                 f"(its adjacency is nodes² float32)")
    if len(links) > max_links:
        top.fail(f"has {len(links):,} links, over the bound of {max_links:,}: pass max_links= to read it")

    read_nodes = [_node(path.name, f"node {k}", entry, len(tokens)) for k, entry in enumerate(entries)]
    order = sorted(range(len(read_nodes)), key=lambda k: KINDS.index(read_nodes[k][1].kind))  # circuit-tracer's
    index: dict[str, int] = {}
    for i, k in enumerate(order):
        node_id = read_nodes[k][0]
        if node_id in index:
            top.fail(f"names two nodes {node_id!r}, so its links are ambiguous (circuit-tracer 0.5.0 gave an "
                     f"error node the id of a layer-0 feature): write the graph again with a later circuit-tracer "
                     f"or qgraph")
        index[node_id] = i
    nodes = [read_nodes[k][1] for k in order]
    logits = [k for k in order if read_nodes[k][1].kind == "logit"]
    layers = {n.layer for n in nodes if n.kind == "logit" and n.layer is not None}
    if len(layers) > 1:
        top.fail(f"has logit nodes at layers {sorted(layers)}: all are at the number of blocks + 1")
    n_layers = layers.pop() if layers else 1 + max((n.layer for n in nodes if n.layer is not None), default=-1)
    deep = [n for n in nodes if n.kind in ("feature", "error") and n.layer is not None and n.layer >= n_layers]
    if deep:
        top.fail(f"has a {deep[0].kind} at layer {deep[0].layer}, not below its logits' layer {n_layers + 1}")
    embedded = {n.position: n.feature for n in nodes if n.kind == "embedding"}
    if sorted(embedded) != list(range(len(tokens))):
        missing = sorted(set(range(len(tokens))) - set(embedded))
        top.fail(f"has no embedding node at positions {missing[:10]} of its {len(tokens)} prompt tokens "
                 f"(circuit-tracer keeps one per token)")

    adjacency = torch.zeros(len(nodes), len(nodes))
    kept = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)
    for k, entry in enumerate(links):
        link = _Checked(path.name, f"link {k}", entry)
        ends = [link.get(key, (str,)) for key in ("source", "target")]
        weight = link.get("weight", (int, float))
        for end in ends:
            if end not in index:
                link.fail(f"names node {end!r}, which the file does not have")
        s, t = index[ends[0]], index[ends[1]]
        if kept[t, s]:
            link.fail(f"repeats the link {ends[0]!r} -> {ends[1]!r}")
        adjacency[t, s], kept[t, s] = weight, True

    labels = {(n.layer, n.feature): read_nodes[k][2] for k, n in zip(order, nodes) if n.kind == "feature"
              and read_nodes[k][2]}
    probabilities = torch.tensor([read_nodes[k][1].probability for k in logits], dtype=torch.float32)
    unknown = torch.full((len(nodes),), math.nan)
    return cls(nodes, adjacency, unknown, unknown.clone(), torch.tensor([embedded[p] for p in range(len(tokens))]),
               probabilities, tokens, [read_nodes[k][2] for k in logits], scan, n_layers, prompt=prompt,
               edges=kept, pruned=(threshold, None), labels=labels)


def _node(source: str, where: str, entry, seq: int) -> tuple[str, Node, str]:
    """One node entry as (its id in the file, the Node, its label: a feature's clerp, a logit's token)."""
    fields = _Checked(source, where, entry)
    node_id = fields.get("node_id", (str,))
    fields.where = f"{where} ({node_id[:40]!r})"
    feature_type = fields.get("feature_type", (str,))
    if feature_type not in KIND_OF:
        fields.fail(f"has feature_type {feature_type[:40]!r}, not one of {', '.join(map(repr, KIND_OF))}")
    kind = KIND_OF[feature_type]
    layer_text, position = fields.get("layer", (str,)), fields.get("ctx_idx", (int,))
    if not 0 <= position < seq:
        fields.fail(f"is at ctx_idx {position}, outside the {seq} prompt tokens")
    influence = fields.get("influence", (int, float, type(None)), None, required=False)
    activation = fields.get("activation", (int, float, type(None)), None, required=False)
    clerp = fields.get("clerp", (str,), "", required=False)
    probability = fields.get("token_prob", (int, float), 0.0, required=False)
    layer = -1  # an embedding's: it has none
    if kind != "embedding":
        if not re.fullmatch(r"[0-9]{1,6}", layer_text):
            fields.fail(f"has layer {layer_text[:20]!r}, not a block number")
        layer = int(layer_text)
    influence = None if influence is None else float(influence)
    if kind == "feature":
        parts = _ID.fullmatch(node_id)
        if parts is None or (int(parts[1]), int(parts[3])) != (layer, position):
            fields.fail(f"is a feature whose id is not '{{layer}}_{{feature}}_{{ctx_idx}}' for layer {layer}")
        made = Node("feature", layer, position, int(parts[2]),
                    activation=None if activation is None else float(activation), influence=influence)
        return node_id, made, clerp
    if kind == "error":
        return node_id, Node("error", layer, position, None, influence=influence), ""
    if kind == "embedding":
        parts = re.fullmatch(r"E_([0-9]{1,18})_([0-9]{1,9})", node_id)
        if parts is None or int(parts[2]) != position:
            fields.fail("is an embedding whose id is not 'E_{token}_{ctx_idx}'")
        return node_id, Node("embedding", None, position, int(parts[1]), influence=influence), ""
    token = fields.get("feature", (int,))
    if layer == 0 or not 0 <= token < 2 ** 62 or not 0 <= probability <= 1:
        fields.fail(f"is a logit at layer {layer} of token {token} with probability {probability}: a logit is "
                    f"above block 0, of a token id, with a probability from 0 to 1")
    said = _LOGIT_CLERP.fullmatch(clerp)
    return node_id, Node("logit", layer - 1, position, token, probability=float(probability)), \
        said[1] if said else str(token)
