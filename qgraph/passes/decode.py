"""The decode pass: turn a prompt program into one decoding step whose memory (its cache) is explicit.

``open_cache(program, recurrent=...)`` rewrites a text program (run as the ``rewrite`` of
``Program.build``: after the on-request rewrites, before the edit slots) so that every piece of
memory a step needs from the steps before it is a program input, and every piece the next step
needs is a program output:

* positions: the rotary's position ids are the input ``positions`` ``[batch, new]`` (HF generate's
  ``cumsum(attention_mask) - 1``) instead of ``arange(seq)``;
* the attention mask: the ``[batch, 1, new, past + new]`` boolean mask every attention block reads
  is the input ``causal_mask`` (built by ``qgraph.generate`` from the full 2D mask, with the causal
  offset ``past``) instead of the one computed from ``attention_mask`` (which stays the program's
  ``[batch, new]`` input: the DeltaNet's padding mask and every reshape read its sizes);
* each attention block: its keys and values (after the rotary, before the kv-head repeat) are
  ``cat(past, new)`` with the past an input ``[batch, kv_heads, past, head_dim]``; the concatenated
  tensors are tapped (``<host>.cache_keys``/``cache_values``: the next step's past). The located
  ``attention_keys``/``values`` stay the new tokens' own;
* each DeltaNet block: the kernel's initial state (``state_input``) and the conv's left context
  (``conv_state_input``) are fed from inputs; ``state_output`` and ``conv_state_output`` are tapped
  (``<host>.cache_state``/``cache_conv``). Edit slots on ``state_input`` still sit after the fed
  node, so on a decode step ``state_input`` is the carried state (edited, if edited);
* with ``recurrent=True`` (the one-token decode program) the chunked delta-rule op becomes the
  token-by-token one, as HF's decode path runs it.

Nodes are found by module scope and op pattern, never by node names.
"""
from __future__ import annotations

import re

import torch
from torch.fx import Node

from ..kernels.ops import DELTA_RULE_OPS
from .emit import fake_result
from .locate import Found, Locator, OnRequest, attention_core
from .swap import open_conv_context

aten = torch.ops.aten
CHUNK_OP, RECURRENT_OP = DELTA_RULE_OPS
_LAYER = re.compile(r"(^|\.)layers\.\d+(\.|$)")


def cache_names(program) -> dict[str, list[str]]:
    """The hosts that carry memory: ``{"self_attn": [...], "linear_attn": [...]}``."""
    mixers = program.family.block_mixers(program.model.config)
    return {kind: [f"layers.{i}.{kind}" for i, mixer in enumerate(mixers) if mixer == kind]
            for kind in ("self_attn", "linear_attn")}


def open_cache(program, recurrent: bool = False) -> dict[str, Found]:
    """Rewrite ``program.graph`` into a cached step (see the module doc); returns the taps to add."""
    graph, config = program.graph, program.model.config
    text = config.get_text_config()
    locator = Locator(graph, program.family, config)
    seq_sizes = _seq_sizes(graph)
    batch_example = 2
    taps: dict[str, Found] = {}

    # positions: what the rotary reads from outside its scope (an int [rows, batch, seq] tensor)
    positions = program._input("positions", lambda inputs: inputs["positions"],
                               torch.zeros(batch_example, 3, dtype=torch.long))
    rotary = locator.scopes.get("rotary_emb") or next(
        (nodes for name, nodes in locator.scopes.items() if name.endswith("rotary_emb") and "visual" not in name), None)
    if not rotary:
        raise NotImplementedError("no rotary embedding module found in the program: cannot offset positions")
    inside = set(rotary)
    readers = {}
    for node in rotary:
        for arg in node.all_input_nodes:
            value = arg.meta.get("val")
            if arg not in inside and isinstance(value, torch.Tensor) and value.dtype == torch.long and value.dim() == 3:
                readers.setdefault(arg, []).append(node)
    if len(readers) != 1:
        raise NotImplementedError(f"expected one position-id input to the rotary, found {len(readers)}")
    (old_positions, users), = readers.items()
    rows = old_positions.meta["val"].shape[0]
    with graph.inserting_before(users[0]):
        lifted = _call(graph, aten.unsqueeze.default, positions, 0)
        new_positions = _call(graph, aten.expand.default, lifted, [rows, -1, -1])
    for user in users:
        user.replace_input_with(old_positions, new_positions)

    # the attention mask: the last 4-D boolean node outside the blocks (what every attention reads)
    masks = [node for node in graph.nodes if _is_bool4(node) and not _in_layer(node, program.family)
             and not any(_is_bool4(user) for user in node.users)]
    self_attn = cache_names(program)["self_attn"]
    if self_attn:
        if len(masks) != 1:
            raise NotImplementedError(f"expected one 4-D boolean attention mask, found {len(masks)}")
        mask = program._input("causal_mask", lambda inputs: inputs["causal_mask"],
                              torch.ones(batch_example, 1, 3, 5, dtype=torch.bool))
        masks[0].replace_all_uses_with(mask)

    # attention blocks: keys and values gain the past
    for host in self_attn:
        core = attention_core(locator.scopes.get(host, ()))
        if core is None:
            raise NotImplementedError(f"no attention computation found under '{host}'")
        for part, node in (("keys", core.keys), ("values", core.values)):
            shape = node.meta["val"].shape
            past = program._input(f"cache.{host}.{part}", lambda inputs, k=f"{host}.{part}": inputs[k],
                                  torch.zeros(batch_example, shape[1], 3, shape[3], dtype=node.meta["val"].dtype))
            readers = list(node.users)
            with graph.inserting_after(node):
                joined = _call(graph, aten.cat.default, [past, node], 2, scope=node)
            for reader in readers:
                reader.replace_input_with(node, joined)
            _free_seq(joined, seq_sizes)
            taps[f"{host}.cache_{part}"] = Found(joined)

    # DeltaNet blocks: the state and the conv context come in, their successors go out
    for host in cache_names(program)["linear_attn"]:
        state_in = program.catalogue[f"{host}.state_input"].location
        state_out = program.catalogue[f"{host}.state_output"].location
        conv_in = program.catalogue[f"{host}.conv_state_input"].location
        if isinstance(conv_in, OnRequest):
            context, tail = open_conv_context(graph, conv_in.node)
        else:
            context, tail = conv_in.node, program.catalogue[f"{host}.conv_state_output"].location.node
        for node, key, example in (
                (state_in.node, f"{host}.state", torch.zeros(batch_example, text.linear_num_value_heads,
                                                             text.linear_key_head_dim, text.linear_value_head_dim)),
                (context, f"{host}.conv", torch.zeros(batch_example, *context.meta["val"].shape[1:],
                                                      dtype=context.meta["val"].dtype))):
            fed = program._input(f"cache.{key}", lambda inputs, k=key: inputs[k], example)
            node.target, node.args, node.kwargs = aten.clone.default, (fed,), {}  # same node: slots and taps stay
        taps[f"{host}.cache_state"] = Found(state_out.node)
        taps[f"{host}.cache_conv"] = Found(tail)
        if recurrent:
            kernel = locator._kernel(host)
            if kernel is not None and kernel.target is CHUNK_OP:
                kernel.target = RECURRENT_OP
    return taps


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

