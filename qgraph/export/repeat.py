"""Export one block of each kind, then repeat it: a fast export of a deep model.

Tracing costs time per traced op (the 24 blocks of the 0.8B shape take ~20 s), yet every block of
one kind traces to the same graph but for its parameters and names. So ``export_model`` traces a
twin whose layer list holds only the first block of each kind (the *seed*: blocks 0 and 3 of
Qwen3.5; a block unlike its kind's first in what the trace bakes in is a seed of its own:
``qgraph.export.variants``), and ``repeat_blocks`` builds the full program from it: for every
block, a copy of its seed's nodes reading that block's parameters, with that block's module scopes
and port names.
The result is the graph a full export gives (tests compare the two node by node).

A seed that does not look like a chain of self-contained blocks (a block reads another block's
inner values, or binds data-dependent sizes) makes ``repeat_blocks`` return None; the caller then
exports the whole model.
"""
from __future__ import annotations

import copy
import functools
import re
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputSpec, TensorArgument
from torch.fx import Node

from .. import compat
from ..kernels import ops

if TYPE_CHECKING:  # a type only: transformers is imported with the model
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class Blocks:
    """A model's repeated blocks: where the list is and which kind each block is."""

    path: str  # the layer list's module path, e.g. "model.layers"
    kinds: tuple[str, ...]  # each block's kind, by block index (config.layer_types)
    kinds_attribute: str | None = None  # the text config's list of kinds, if the owner loops over it
    # each block's variant of its kind (``qgraph.export.variants``: blocks that differ from their kind's
    # first block in what the trace bakes in); () when every block is its kind's first block's variant
    variants: tuple[int, ...] = ()
    apart: tuple[str, ...] = field(default=(), compare=False)  # why each variant past the first is one

    def group(self, index: int) -> tuple[str, int]:
        """Block ``index``'s kind and variant: the blocks of one group repeat one seed block."""
        return self.kinds[index], self.variants[index] if self.variants else 0

    @property
    def seed(self) -> tuple[int, ...]:
        """The first block of each kind (and variant), in block order: the blocks the seed export traces."""
        first: dict[tuple[str, int], int] = {}
        for index in range(len(self.kinds)):
            first.setdefault(self.group(index), index)
        return tuple(sorted(first.values()))

    def worth_repeating(self) -> bool:
        return len(self.seed) < len(self.kinds)


def repeated_blocks(model: PreTrainedModel, family, images: bool) -> list[Blocks]:
    """The block lists of ``model`` that the export of its (image-text if ``images``) program can
    trace once per kind, per the family's ``repeated_blocks``."""
    modules = dict(model.named_modules())
    text = model.config.get_text_config()
    found = []
    for listed in family.repeated_blocks:
        layers = modules.get(listed.path)
        if not isinstance(layers, torch.nn.ModuleList) or (listed.image_only and not images):
            continue
        kinds = (tuple(getattr(text, listed.kinds_attribute)[: text.num_hidden_layers]) if listed.kinds_attribute
                 else ("block",) * len(layers))
        blocks = Blocks(listed.path, kinds, listed.kinds_attribute)
        if blocks.worth_repeating():
            found.append(blocks)
    return found


def seeded(twin: torch.nn.Module, blocks: Blocks) -> torch.nn.Module:
    """``twin`` (a shallow copy of the model) whose block list holds only the seed blocks (and whose
    text config says so, where the owner loops over it); the modules on the way are shallow copies,
    the model is not touched."""
    owner_path, _, attribute = blocks.path.rpartition(".")
    parts = owner_path.split(".") if owner_path else []
    parent = compat.own_children(twin)  # the twin's own module dict, not the model's
    for name in parts:
        parent = compat.replace_child(parent, name, compat.shallow_twin)
    compat.replace_child(parent, attribute,
                         lambda layers: torch.nn.ModuleList([layers[index] for index in blocks.seed]))
    if blocks.kinds_attribute:  # the text model loops over config.num_hidden_layers / layer_types
        owner = cast("PreTrainedModel", parent)  # the text model: its list's owner, a transformers model
        config = copy.copy(owner.config)
        config.num_hidden_layers = len(blocks.seed)
        setattr(config, blocks.kinds_attribute, [blocks.kinds[index] for index in blocks.seed])
        owner.config = config
    return twin


class _Unrepeatable(Exception):
    """The seed graph is not a chain of self-contained blocks."""


def repeat_blocks(seed: ExportedProgram, model: PreTrainedModel, family, blocks: Blocks) -> ExportedProgram | None:
    """The full program of ``model`` built from the export of its seeded twin (None if it cannot be)."""
    try:
        return _Repeater(seed, model, family, blocks).program()
    except _Unrepeatable:
        return None
    except Exception as error:  # a layout this code has not met: exporting every block is still right
        warnings.warn(f"qgraph: could not repeat the blocks of {blocks.path} ({type(error).__name__}: {error}); "
                      f"exporting every block instead", stacklevel=3)
        return None


class _Repeater:
    def __init__(self, seed: ExportedProgram, model, family, blocks: Blocks):
        self.seed, self.model, self.family, self.blocks = seed, model, family, blocks
        self.graph = seed.graph
        # seed position (index in the twin's layer list) of every block kind and variant
        self.position_of_group = {blocks.group(index): position for position, index in enumerate(blocks.seed)}
        self._split()

    # -- the seed graph: prefix, one run of nodes per seed block, suffix --------------------------

    def _position(self, node: Node) -> int | None:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            if path.startswith(self.blocks.path + "."):
                index = path[len(self.blocks.path) + 1:].split(".")[0]
                if index.isdigit():
                    return int(index)
        return None

    def _split(self):
        nodes = [node for node in self.graph.nodes if node.op not in ("placeholder", "output")]
        positions = [self._position(node) for node in nodes]
        count = len(self.blocks.seed)
        runs = {position: [] for position in range(count)}
        phase = 0  # 0: prefix, 1: in the blocks, 2: suffix
        self.prefix, self.suffix, last = [], [], -1
        shared = _shared_sizes(nodes, positions)
        placed: set[Node] = set()  # the nodes of the blocks' runs
        for node, position in zip(nodes, positions):
            if node in shared and placed.isdisjoint(node.all_input_nodes):
                self.prefix.append(node)  # a size of the inputs that later blocks read: computed before them
                continue
            if position is None:
                if phase == 1:
                    if last != count - 1:
                        raise _Unrepeatable(f"{node} between blocks")
                    phase = 2
                (self.prefix if phase == 0 else self.suffix).append(node)
                continue
            if phase == 2 or position < last or position > last + 1 or position >= count:
                raise _Unrepeatable(f"{node} of block {position} out of order")
            phase, last = 1, position
            runs[position].append(node)
            placed.add(node)
        if last != count - 1:
            raise _Unrepeatable("a seed block has no nodes")
        self.runs = runs
        self.inside = {node: position for position, run in runs.items() for node in run}
        self.hidden_in, self.hidden_out = {}, {}
        for position, run in runs.items():
            index = self.blocks.seed[position]
            name = self.family.module_name(f"{self.blocks.path}.{index}")
            marks = {node.args[1]: node for node in run if node.target == ops.MARK_OP}
            try:
                self.hidden_in[position] = marks[f"{name}.input"].args[0]
                self.hidden_out[position] = marks[f"{name}.output"]
            except KeyError as missing:
                raise _Unrepeatable(f"block {index} has no port {missing}") from None
            for node in run:
                if node.meta.get("unbacked_bindings"):
                    raise _Unrepeatable(f"{node} binds a data-dependent size")
                for arg in node.all_input_nodes:
                    where = self.inside.get(arg)
                    if where is not None and where != position and arg is not self.hidden_in[position]:
                        raise _Unrepeatable(f"{node} of block {index} reads {arg} of another block")
        last_out = self.hidden_out[count - 1]
        for node in [*self.suffix, self.graph.output_node()]:
            for arg in node.all_input_nodes:
                if arg in self.inside and arg is not last_out:
                    raise _Unrepeatable(f"{node} reads {arg} inside a block")

    # -- the full graph ----------------------------------------------------------------------------

    def _block_target(self, target: str, position: int) -> str | None:
        """The part of a parameter/buffer target after the seed block's path (None: not the block's)."""
        prefix = f"{self.blocks.path}.{position}."
        return target[len(prefix):] if target.startswith(prefix) else None

    def program(self) -> ExportedProgram:
        graph = torch.fx.Graph()
        env: dict[Node, Node] = {}
        specs: list[InputSpec] = []
        per_block: dict[tuple[int, Node], Node] = {}  # (block index, seed placeholder) -> its placeholder
        placeholders = {node.name: node for node in self.graph.find_nodes(op="placeholder")}
        seed_specs = self.seed.graph_signature.input_specs
        emitted_kinds = set()
        count = len(self.blocks.kinds)
        for spec in seed_specs:
            node = placeholders[spec.arg.name]
            in_block = (spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and spec.target is not None
                        and any(self._block_target(spec.target, p) is not None for p in self.runs))
            if not in_block:
                env[node] = _copy_placeholder(graph, node, node.name)
                specs.append(spec)
                continue
            if spec.kind in emitted_kinds:
                continue
            emitted_kinds.add(spec.kind)
            # every block's tensors of this kind, in block order (as a full export lists them)
            for index in range(count):
                position = self.position_of_group[self.blocks.group(index)]
                for other in seed_specs:
                    rest = other.kind == spec.kind and other.target and self._block_target(other.target, position)
                    if not rest:
                        continue
                    target = f"{self.blocks.path}.{index}.{rest}"
                    # the name a full export gives it: the seed's, with the block index changed
                    seed_scope, scope = (f"_{self.blocks.path.replace('.', '_')}_{n}_" for n in (position, index))
                    new = _copy_placeholder(graph, placeholders[other.arg.name],
                                            other.arg.name.replace(seed_scope, scope, 1))
                    per_block[(index, placeholders[other.arg.name])] = new
                    specs.append(InputSpec(other.kind, TensorArgument(new.name), target, other.persistent))

        for node in self.prefix:
            env[node] = graph.node_copy(node, lambda arg: env[arg])
        hidden = env[self.hidden_in[0]]
        for index in range(count):
            position = self.position_of_group[self.blocks.group(index)]
            seed_index = self.blocks.seed[position]
            local: dict[Node, Node] = {}

            def read(arg, position=position, index=index, local=local, hidden=hidden):
                if arg is self.hidden_in[position]:
                    return hidden
                if arg in local:
                    return local[arg]
                if (index, arg) in per_block:
                    return per_block[(index, arg)]
                return env[arg]

            ports = self._port_renames(seed_index, index)
            seed_path = re.compile(re.escape(f"{self.blocks.path}.{position}") + r"(?=\.|$)")
            for node in self.runs[position]:
                new = graph.node_copy(node, read)
                if node.target == ops.MARK_OP:
                    port, _, side = node.args[1].rpartition(".")
                    new.args = (new.args[0], f"{ports[port]}.{side}", *new.args[2:])
                stack = node.meta.get("nn_module_stack")
                if stack:
                    here = f"{self.blocks.path}.{index}"
                    new.meta["nn_module_stack"] = {seed_path.sub(here, key): (seed_path.sub(here, path), kind)
                                                   for key, (path, kind) in stack.items()}
                local[node] = new
            hidden = local[self.hidden_out[position]]
        last_out = self.hidden_out[len(self.blocks.seed) - 1]
        env[last_out] = hidden
        for node in [*self.suffix, self.graph.output_node()]:
            env[node] = graph.node_copy(node, lambda arg: env[arg])
        return self._exported(graph, specs, env)

    def _port_renames(self, seed_index: int, index: int) -> dict[str, str]:
        """Port names of the seed block's modules -> those of block ``index``'s."""
        seed_path, path = f"{self.blocks.path}.{seed_index}", f"{self.blocks.path}.{index}"
        return {self.family.module_name(module_path): self.family.module_name(path + module_path[len(seed_path):])
                for module_path in self._module_paths
                if module_path == seed_path or module_path.startswith(seed_path + ".")}

    @functools.cached_property
    def _module_paths(self) -> list[str]:
        """Every module path of the model (walked once, not once per block)."""
        return [module_path for module_path, _ in self.model.named_modules()]

    def _exported(self, graph: torch.fx.Graph, specs: list[InputSpec], env: dict[Node, Node]) -> ExportedProgram:
        seed = self.seed
        outputs = seed.graph.output_node().args[0]
        renamed = {node.name: env[node].name for node in outputs if isinstance(node, Node)}
        output_specs = [OutputSpec(spec.kind, _renamed_argument(spec.arg, renamed), spec.target)
                        for spec in seed.graph_signature.output_specs]
        module_call_graph = []
        for entry in seed.module_call_graph:
            entry = copy.copy(entry)
            if entry.signature is not None:
                entry.signature = copy.copy(entry.signature)
                entry.signature.outputs = [_renamed_argument(arg, renamed) for arg in entry.signature.outputs]
            module_call_graph.append(entry)
        state_dict, constants = {}, dict(seed.constants)
        for spec in specs:
            if spec.kind == InputKind.PARAMETER:
                state_dict[spec.target] = self.model.get_parameter(spec.target)
            elif spec.kind == InputKind.BUFFER:
                buffer = self.model.get_buffer(spec.target)
                (state_dict if spec.persistent else constants)[spec.target] = buffer
        return compat.exported_program(
            compat.lazy_graph_module(seed.graph_module, graph), graph, ExportGraphSignature(specs, output_specs),
            state_dict, seed.range_constraints, module_call_graph, constants, seed.verifier)


def _shared_sizes(nodes: list[Node], positions: list[int | None]) -> set[Node]:
    """The sizes (symbolic ints, floats, bools: no tensor) a block computes and another block reads, with
    the sizes they are computed from in their block. Export computes an expression of the inputs' sizes
    once and lets every later block read it (a PLE's ``seq + 2``); such a size moves before the blocks,
    if it reads nothing else of a block (``_split`` checks)."""
    position = dict(zip(nodes, positions))
    shared: set[Node] = set()

    def share(node: Node) -> None:
        if node in shared or position.get(node) is None or not _sizes_only(node):
            return
        shared.add(node)
        for arg in node.all_input_nodes:
            share(arg)
    for node in nodes:
        for arg in node.all_input_nodes:
            if position.get(arg) is not None and position[arg] != position[node]:
                share(arg)
    return shared


def _sizes_only(node: Node) -> bool:
    """Whether ``node`` computes a size (a symbolic int, float or bool), no tensor."""
    return node.op == "call_function" and isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat,
                                                                              torch.SymBool))


def _copy_placeholder(graph: torch.fx.Graph, node: Node, name: str) -> Node:
    new = graph.placeholder(name)
    new.meta = dict(node.meta)
    return new


def _renamed_argument(argument, renamed: dict[str, str]):
    name = getattr(argument, "name", None)
    if name in renamed:
        return type(argument)(name=renamed[name])
    return argument
