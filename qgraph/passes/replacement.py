"""The replacement model of an attribution graph: transcoders at every block's MLP, and the model
frozen around them, so that with the features fixed every block is linear in the residual stream.

The rewrite keeps every number the model computes; it changes only where gradients flow:

* each block's MLP output ``m`` (the port of ``layers.{i}.mlp.mlp_output``; a dense MLP or the sparse
  MoE block alike) becomes ``skip(x) + stop(recon + error) + inject_i`` with ``x`` what the block's
  transcoder reads (``layers.{i}.mlp_input`` or ``layers.{i}.layer_mid``), ``recon`` its features'
  decoding (``decode(encode(x))``; of a cross-layer transcoder, every decoder of blocks 0..i writing
  block i: ``decode_to(i, features_0..i)``) and ``error = m - recon - skip(x)``: the same value, but the features and
  the error are constants, a gradient reaches ``x`` only through the transcoder's skip path, and
  ``inject_i`` (a program input of zeros) is where the gradient at the MLP output is read;
* the embeddings (block 0's input) gain ``inject_embeddings`` the same way;
* frozen (``stop``: the value, without its gradient): every ``rsqrt`` (each RMSNorm's 1/rms, the final
  norm's and the DeltaNet's gated norm's included), every ``sigmoid`` (the attention output gate, the
  DeltaNet's betas), every ``softmax`` (eager attention probabilities), the queries and keys of every
  sdpa (so its probabilities), the queries, keys, decays and betas of every delta-rule kernel (its
  output is then linear in its values), every ``silu`` (the gated norm's ``silu(z)``) but the conv's
  SiLU on a delta-rule kernel's values, which becomes ``x * stop(sigmoid(x))``.

Nodes are found by op pattern and by the standard values' ports, never by node names. The pass taps
``replacement.{i}.features`` (the transcoder's features) and ``replacement.{i}.error`` (``[batch seq
hidden]``) into ``build.taps``; ``qgraph.circuits`` reads them and the gradients at the inputs.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.fx import Graph, Node

from ..errors import InvalidArgument
from ..kernels.ops import DELTA_RULE_OPS, MARK_OP
from .base import BuildPass, PassResult
from ..rewrites.emit import MethodCall, emit_module, emitter
from ..values.locate import Found
from ..rewrites.clt import BlockCall

aten = torch.ops.aten
_MIXING = {aten.conv1d.default, aten.mm.default, aten.addmm.default, aten.linear.default, aten.matmul.default,
           aten.bmm.default, aten.convolution.default}
_SDPA = aten.scaled_dot_product_attention.default
_SOFTMAX = {aten.softmax.int, aten._softmax.default}
EMBEDDINGS = "inject_embeddings"
ATTENTION = "attention"  # the request ``replacement=ATTENTION``: freeze the attention alone (no transcoders)

# (replay?, {stop: value}) while a frozen run records the frozen values or replays them
_FROZEN: contextvars.ContextVar = contextvars.ContextVar("qgraph_frozen", default=None)


class Stop(torch.nn.Module):
    """A frozen coefficient: its input's value without its gradient. Inside ``frozen(values)`` it
    records the value into ``values``; inside ``frozen(values, replay=True)`` it returns the recorded
    one instead, so the coefficients of another run stay those of the recorded run (an intervention on
    the replacement model then moves every target linearly)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = _FROZEN.get()
        if state is not None:
            replay, values = state
            if replay:
                return values[self]
            values[self] = x.detach()
        return x.detach()


@contextlib.contextmanager
def frozen(values: dict, replay: bool = False):
    """Record the frozen coefficients of the runs in this block into ``values`` (``replay=False``), or
    run with those recorded (``replay=True``); this thread or task only."""
    token = _FROZEN.set((replay, values))
    try:
        yield values
    finally:
        _FROZEN.reset(token)


def inject_name(block: int) -> str:
    """The program input where the gradient at block ``block``'s MLP output is read."""
    return f"inject_{block}"


class Replacement(BuildPass):
    """Transcoders at every block's MLP and the model frozen around them (see the module doc); runs
    for a request with ``replacement={block: transcoder}``. ``replacement=ATTENTION`` freezes the
    attention alone (the queries and keys of every sdpa, the queries, keys, decays and betas of every
    delta-rule kernel) and splices nothing: ``circuits.feature_intervention(freeze_attention=True)``."""

    markers = True

    @classmethod
    def wanted(cls, build) -> bool:
        return build.request.replacement is not None

    def call(self, graph_module) -> PassResult:
        program, transcoders = self.build.program, self.build.request.replacement
        stops = _Stops(graph_module)
        if isinstance(transcoders, str) and transcoders == ATTENTION:
            _freeze_attention(graph_module.graph, stops)
            return PassResult(graph_module, True)
        _freeze(graph_module.graph, stops)
        _inject(program, _port(program, "layers.0.layer_input"), EMBEDDINGS)
        # every block's features, in block order: a cross-layer decoder reads those of the blocks before
        features: list[Node] = []
        for block, calls in _calls(graph_module, transcoders):
            x = _port(program, f"layers.{block}.{calls.reads}")
            m = _port(program, f"layers.{block}.mlp.mlp_output")
            error, out = _splice(graph_module, stops, calls, x, m, features)
            _inject(program, out, inject_name(block))
            self.build.taps[f"replacement.{block}.features"] = Found(features[-1])
            self.build.taps[f"replacement.{block}.error"] = Found(error)
        return PassResult(graph_module, True)


class _BlockCalls:
    """The submodules of one block's transcoder in the graph: ``encode`` and ``skip`` read the block's
    input, ``decode`` the features of this block (``cross=False``) or of every block up to it."""

    def __init__(self, graph_module, block: int, transcoder, reads: str, cross: bool):
        self.reads, self.cross, self.width = reads, cross, transcoder.d_sae
        self.names = {}
        for method in ("encode", "decode", "skip"):
            name = f"replacement__{block}__{method}"
            call = BlockCall(transcoder, "decode_to" if method == "decode" else method, block) if cross \
                else MethodCall(transcoder, method)
            graph_module.add_submodule(name, call)
            self.names[method] = name


def _calls(graph_module, transcoders):
    """``(block, _BlockCalls)`` of every block, in order: ``{block: Transcoder}``, or a cross-layer
    transcoder (``saes.clt.CrossLayerTranscoder``: every block)."""
    if isinstance(transcoders, dict):
        return [(block, _BlockCalls(graph_module, block, tc, tc.reads, False))
                for block, tc in sorted(transcoders.items())]
    return [(block, _BlockCalls(graph_module, block, transcoders, transcoders.reads, True))
            for block in range(transcoders.n_layers)]


def _port(program, name: str) -> Node:
    """The marker of a standard value found as a module port."""
    entry = program.catalogue.get(name)
    if entry is None or not isinstance(entry.location, Found) or entry.location.node.target is not MARK_OP:
        raise InvalidArgument(f"the replacement model needs '{name}' as a module port, and this program has "
                              f"{'no such value' if entry is None else entry.location}")
    return entry.location.node


class _Stops:
    """Adds ``Stop`` calls to one graph module (``stop__0``, ``stop__1``, ...)."""

    def __init__(self, graph_module):
        self.graph_module, self.count = graph_module, 0

    def __call__(self, node: Node) -> Node:
        """A ``Stop`` of ``node``, inserted where the graph's insert point is."""
        name = f"stop__{self.count}"
        self.count += 1
        self.graph_module.add_submodule(name, Stop())
        stopped = self.graph_module.graph.call_module(name, (node,))
        stopped.meta.update({key: node.meta[key] for key in ("val", "nn_module_stack", "stack_trace")
                             if key in node.meta})
        return stopped

    def after(self, node: Node) -> None:
        """Every reader of ``node`` reads its ``Stop`` instead."""
        readers = list(node.users)
        with self.graph_module.graph.inserting_after(node):
            stopped = self(node)
        for reader in readers:
            reader.replace_input_with(node, stopped)

    def argument(self, node: Node, index: int) -> None:
        """``node`` reads its argument ``index`` through a ``Stop``."""
        with self.graph_module.graph.inserting_before(node):
            node.update_arg(index, self(node.args[index]))


def _freeze(graph: Graph, stops: _Stops) -> None:
    """Stop the gradient through every coefficient that depends on the stream (the module doc's list)."""
    kernels = [node for node in graph.nodes if node.target in DELTA_RULE_OPS]
    conv_gates = {silu for kernel in kernels for silu in _silus_before(kernel.args[2])}
    for node in list(graph.nodes):
        if node.target in (aten.rsqrt.default, aten.sigmoid.default) or node.target in _SOFTMAX:
            stops.after(node)
        elif node.target is aten.silu.default and node in conv_gates:
            _linearise_silu(graph, stops, node)
        elif node.target is aten.silu.default:
            stops.after(node)
    _freeze_attention(graph, stops)


def _freeze_attention(graph: Graph, stops: _Stops) -> None:
    """Stop the gradient through (and, replayed, hold) what mixes positions: sdpa's queries and keys
    (its probabilities), a delta-rule kernel's queries, keys, decays and betas."""
    for node in list(graph.nodes):
        if node.target is _SDPA:  # frozen queries and keys: frozen probabilities
            for index in (0, 1):
                stops.argument(node, index)
        elif node.target in DELTA_RULE_OPS:  # queries, keys, decays, betas: the output is linear in values
            for index in (0, 1, 3, 4):
                stops.argument(node, index)


def _silus_before(value: Node, depth: int = 12) -> set[Node]:
    """The ``silu`` nodes a delta-rule kernel's values come from through re-layouts and splits (the
    conv's SiLU), not through a mixing op."""
    found, frontier, seen = set(), [(value, 0)], set()
    while frontier:
        node, steps = frontier.pop()
        if node in seen or steps > depth or not isinstance(node, Node):
            continue
        seen.add(node)
        if node.target is aten.silu.default:
            found.add(node)
        elif node.op == "call_function" and node.target not in _MIXING:
            frontier += [(arg, steps + 1) for arg in node.all_input_nodes]
    return found


def _linearise_silu(graph: Graph, stops: _Stops, silu: Node) -> None:
    """``silu(x)`` becomes ``x * stop(sigmoid(x))``: the same value, linear in ``x``."""
    x = silu.args[0]
    emit = emitter(graph, silu)
    with graph.inserting_before(silu):
        linear = emit(aten.mul.Tensor, x, stops(emit(aten.sigmoid.default, x)))
    silu.replace_all_uses_with(linear)
    graph.erase_node(silu)


def _splice(graph_module, stops: _Stops, calls: _BlockCalls, x: Node, m: Node, features: list) -> tuple[Node, Node]:
    """At one block: what reads the MLP output ``m`` reads ``skip(x) + stop(recon + error)``, ``recon``
    the decoders writing this block (of its own features, or of every block's up to it: ``features``,
    to which this block's are appended); returns the error and that new output."""
    graph = graph_module.graph
    readers = list(m.users)
    value = m.meta["val"]
    with value.fake_mode:
        wide = value.new_empty(*value.shape[:-1], calls.width)
    emit = emitter(graph, m)
    with graph.inserting_before(m.next):  # in order, after m
        features.append(emit_module(graph, m, calls.names["encode"], (x,), wide))
        decoded = tuple(features) if calls.cross else (features[-1],)
        recon = emit_module(graph, m, calls.names["decode"], decoded, value)
        skip = emit_module(graph, m, calls.names["skip"], (x,), value)
        error = emit(aten.sub.Tensor, emit(aten.sub.Tensor, m, recon), skip)
        out = emit(aten.add.Tensor, skip, stops(emit(aten.add.Tensor, recon, error)))
    for reader in readers:
        reader.replace_input_with(m, out)
    return error, out


def _inject(program, node: Node, name: str) -> None:
    """What reads ``node`` reads ``node + inject`` (``inject`` a new program input of zeros shaped like it)."""
    readers = list(node.users)
    value = node.meta["val"]
    example = torch.zeros(2, 3, value.shape[-1], dtype=value.dtype)
    inject = program.add_input(name, lambda inputs, key=name: inputs[key], example)
    graph = program.graph
    with graph.inserting_after(node):
        added = graph.call_function(aten.add.Tensor, (node, inject))
    added.meta.update({key: node.meta[key] for key in ("val", "nn_module_stack", "stack_trace") if key in node.meta})
    for reader in readers:
        reader.replace_input_with(node, added)
