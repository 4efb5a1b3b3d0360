"""The decode pass: turn a prompt program into one decoding step whose memory (its cache) is explicit.

``OpenCache`` rewrites a text program (in the pipeline, ``passes.pipeline``, of a build with a
``cache``: after the on-request rewrites, before the edit slots) so that every piece of
memory a step needs from the steps before it is a program input, and every piece the next step
needs is a program output:

* positions: the rotary's position ids are the input ``positions`` ``[batch, new]`` (HF generate's
  ``cumsum(attention_mask) - 1``) instead of ``arange(seq)``;
* the attention mask: the ``[batch, 1, new, past + new]`` boolean mask every attention block reads
  is the input ``causal_mask`` (built by ``qgraph.generate`` from the full 2D mask, with the causal
  offset ``past``) instead of the one computed from ``attention_mask`` (which stays the program's
  ``[batch, new]`` input: the DeltaNet's padding mask and every reshape read its sizes);
* each growing memory (``Memory`` without ``carries``): an attention block's keys and values (after
  the rotary, before the kv-head repeat), or the host's value it ``grows`` (qwen4_exp's indexer keys),
  become ``cat(past, new)`` along the memory's ``past`` axis, the past an input (``[batch, kv_heads,
  past, head_dim]`` for keys); the concatenated tensors are tapped (``<host>.cache_keys``/...: the
  next step's past). The located values stay the new tokens' own;
* each carried memory: the value it enters by is fed from an input, the value it leaves by tapped
  (a DeltaNet's ``state_input``/``state_output`` and ``conv_state_input``/``conv_state_output`` as
  ``<host>.cache_state``/``cache_conv``; a PLE layer's contexts). Edit slots on ``state_input`` still
  sit after the fed node, so on a decode step ``state_input`` is the carried state (edited, if edited);
* the positions: where the family's rotary reads every token's position (``rotary_reads_past``) the
  input ``positions`` holds them all, ``[batch, past + new]``;
* with ``recurrent=True`` (the one-token decode program) the chunked delta-rule op becomes the
  token-by-token one, as HF's decode path runs it.

Nodes are found by module scope and op pattern, never by node names.
"""
from __future__ import annotations

import re

import torch
from torch.fx import Node

from ..errors import InternalError
from ..kernels.ops import DELTA_RULE_OPS
from .base import BuildPass, PassResult
from ..rewrites.emit import fake_result
from ..values.locate import Found, Locator, attention_core

aten = torch.ops.aten
CHUNK_OP, RECURRENT_OP = DELTA_RULE_OPS
_LAYER = re.compile(r"(^|\.)layers\.\d+(\.|$)")
_BATCH_EXAMPLE = 2  # the batch of the fake examples new inputs are shaped like


class OpenCache(BuildPass):
    """Rewrite a prompt program into a cached step (see the module doc): the build's ``cache`` is
    ``"prompt"`` (the chunked kernel) or ``"decode"`` (one token: the token-by-token kernel). Runs after
    the on-request rewrites (the build makes every carried value first: ``carried(family, config)``);
    writes the memory to tap to ``build.taps``."""

    markers = True

    @classmethod
    def wanted(cls, build) -> bool:
        return build.request.cache is not None

    def __repr__(self) -> str:
        return f"OpenCache(recurrent={self.recurrent})"

    @property
    def recurrent(self) -> bool:
        return self.build.request.cache == "decode"

    def call(self, graph_module) -> PassResult:
        program = self.build.program
        family, config = program.family, program.model.config
        locator = Locator(graph_module.graph, family, config)
        _feed_positions(program, locator)
        memory = family.memories(config)
        if any(piece.carries is None for _, piece in memory):  # a growing memory: attention reads the mask
            _feed_mask(program)
        seq_sizes = _seq_sizes(graph_module.graph)
        taps = self.build.taps
        for host, piece in memory:
            if piece.carries:
                taps[f"{host}.cache_{piece.name}"] = _carry(program, host, piece)
            else:
                taps[f"{host}.cache_{piece.name}"] = _grow(program, locator, host, piece, seq_sizes)
        for host, mixer in family.memory_hosts(config):
            if self.recurrent and mixer.recurrent:  # one token: the token-by-token kernel, as HF decodes
                kernel = locator.kernel(host)
                if kernel is not None and kernel.target is CHUNK_OP:
                    kernel.target = RECURRENT_OP
        return PassResult(graph_module, True)


def carried(family, config) -> list[str]:
    """The values a cached step feeds from, taps into its memory or grows (made before ``OpenCache`` runs)."""
    return [f"{host}.{value}" for host, piece in family.memories(config)
            for value in (piece.carries or ((piece.grows,) if piece.grows else ()))]


def _feed_positions(program, locator) -> None:
    """The rotary reads the input ``positions`` [batch, new] (as ``[rows, batch, new]`` where it takes
    several rows) instead of the positions it computes from the sequence length."""
    family, graph = program.family, program.graph
    rows = family.position_rows
    positions = program.add_input("positions", lambda inputs: inputs["positions"],
                                  torch.zeros(_BATCH_EXAMPLE, 3, dtype=torch.long))
    rotary = locator.scopes.get(family.rotary)
    if not rotary:
        raise InternalError(f"no rotary embedding module '{family.rotary}' found in the program: cannot "
                            f"offset positions")
    inside = set(rotary)
    readers: dict[Node, list[Node]] = {}  # a position-id input of the rotary -> the rotary nodes that read it
    for node in rotary:
        for arg in node.all_input_nodes:
            value = arg.meta.get("val")
            if arg not in inside and isinstance(value, torch.Tensor) and value.dtype == torch.long \
                    and value.dim() == (3 if rows > 1 else 2):
                readers.setdefault(arg, []).append(node)
    if len(readers) != 1:
        raise InternalError(f"expected one position-id input to the rotary, found {len(readers)}")
    (old_positions, users), = readers.items()
    new_positions = positions
    if rows > 1:
        with graph.inserting_before(users[0]):
            lifted = _call(graph, aten.unsqueeze.default, positions, 0)
            new_positions = _call(graph, aten.expand.default, lifted, [rows, -1, -1])
    for user in users:
        user.replace_input_with(old_positions, new_positions)


def _feed_mask(program) -> None:
    """Every attention reads the input ``causal_mask`` [batch, 1, new, past + new]: the last 4-D
    boolean node outside the blocks is replaced by it."""
    graph = program.graph
    def outside(node):
        return _is_bool4(node) and not _in_layer(node, program.family)
    masks = [node for node in graph.nodes if outside(node) and not any(outside(user) for user in node.users)]
    if len(masks) != 1:
        raise InternalError(f"expected one 4-D boolean attention mask, found {len(masks)}")
    mask = program.add_input("causal_mask", lambda inputs: inputs["causal_mask"],
                             torch.ones(_BATCH_EXAMPLE, 1, 3, 5, dtype=torch.bool))
    masks[0].replace_all_uses_with(mask)


def _grow(program, locator, host: str, piece, seq_sizes) -> Found:
    """An attention's keys or values, or the host's value ``piece.grows``, become ``cat(past, new)`` along the
    piece's ``past`` axis, the past an input; returns the joined tensor."""
    if piece.grows:
        node = program.catalogue[f"{host}.{piece.grows}"].location.node
    else:
        core = attention_core(locator.scopes.get(host, ()))
        if core is None:
            raise InternalError(f"no attention computation found under '{host}'")
        node = getattr(core, piece.name)
    axis = 1 + piece.dims.index("past")
    example = [_BATCH_EXAMPLE, *node.meta["val"].shape[1:]]
    example[axis] = 3
    past = program.add_input(f"cache.{host}.{piece.name}", lambda inputs, k=f"{host}.{piece.name}": inputs[k],
                             torch.zeros(example, dtype=node.meta["val"].dtype))
    readers = list(node.users)
    with program.graph.inserting_after(node):
        joined = _call(program.graph, aten.cat.default, [past, node], axis, scope=node)
    for reader in readers:
        reader.replace_input_with(node, joined)
    _free_seq(joined, seq_sizes)
    return Found(joined)


def _carry(program, host: str, piece) -> Found:
    """A carried state's input value is fed from the input ``cache.<host>.<name>``; returns its output value."""
    value_in, value_out = piece.carries
    node = program.catalogue[f"{host}.{value_in}"].location.node
    config = program.model.config
    sizes = [program.family.dim(config, dim) for dim in piece.dims]
    example = torch.zeros(_BATCH_EXAMPLE, *sizes, dtype=torch.float32 if piece.float32 else node.meta["val"].dtype)
    key = f"{host}.{piece.name}"
    fed = program.add_input(f"cache.{key}", lambda inputs, k=key: inputs[k], example)
    node.target, node.args, node.kwargs = aten.clone.default, (fed,), {}  # same node: slots and taps stay
    return Found(program.catalogue[f"{host}.{value_out}"].location.node)


def _seq_sizes(graph) -> set[Node]:
    """The symbolic sequence length nodes (``sym_size(input, 1)`` of the token inputs)."""
    return {node for node in graph.find_nodes(op="call_function", target=aten.sym_size.int)
            if node.args[1] == 1 and node.args[0].op == "placeholder"
            and node.args[0].name in ("input_ids", "attention_mask")}


def _free_seq(start: Node, seq_sizes: set[Node]) -> None:
    """From ``start`` (the joined keys or values) to the attention op, let every reshape and expand
    take the joined length (``-1``) where they fixed the new tokens' count."""
    frontier = [start]
    while frontier:
        node = frontier.pop()
        for user in list(node.users):
            if user.target in (aten.scaled_dot_product_attention.default, aten.matmul.default):
                continue
            if user.target in (aten.expand.default, aten.reshape.default, aten.view.default,
                               aten._unsafe_view.default) and isinstance(user.args[1], (list, tuple)):
                user.args = (user.args[0], [-1 if size in seq_sizes else size for size in user.args[1]])
            frontier.append(user)


def _call(graph, op, *args, scope: Node | None = None) -> Node:
    node = graph.call_function(op, args)
    if scope is not None:
        node.meta.update({k: scope.meta[k] for k in ("nn_module_stack", "stack_trace") if k in scope.meta})
    try:
        node.meta["val"] = fake_result(op, args)
    except Exception:  # noqa: BLE001 - a placeholder's example size vs a symbolic one: keep a shape-alike
        source = next((a for a in args if isinstance(a, Node)), None)
        if source is None:
            source = args[0][-1]
        node.meta["val"] = source.meta.get("val")
    return node


def _is_bool4(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 4


def _in_layer(node: Node, family) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(_LAYER.search(family.module_name(path) or "") for path, _ in stack.values())

