"""The schema a model family fills in: everything qgraph knows about one kind of model, as data.

A family file (``qwen3_5.py``) builds one ``Family`` and registers it (``registry``). The rest of
qgraph asks the family, never the model's config or module names: which rule finds which value
(``values``), how module paths are named (``module_renames``), which mixer each block carries
(``mixers``), what a decoding step carries from one token to the next (``Mixer.memory``, and
``memory`` for other hosts), where the rotary reads its position ids (the new tokens', or all so far),
which blocks trace alike (``repeated_blocks``), which delta-rule kernels its DeltaNet calls
(``Kernels``), and, for an image-text model, its image part (``Images``: the image inputs, the export
patches, and the vision tower's values, hosts, dims and blocks).

Families are composed by named operations: ``with_images`` adds an image part and ``without_images``
removes exactly it; ``with_host_values`` swaps the values of one host (a dense MLP's for a MoE block's).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument
from .rules import ValueSpec

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# A layout dim's size: an attribute of the text config, or a function of the model's config
DimSource = str | Callable[["PretrainedConfig"], int]
# (model) -> a context manager active while a program is exported
ExportPatches = Callable[["torch.nn.Module"], AbstractContextManager[Any]]
# (config) -> why a model of the family cannot be served, or None
Check = Callable[["PretrainedConfig"], "str | None"]


@dataclass(frozen=True)
class Memory:
    """One piece of memory a decoding step hands to the next, per host (each block's mixer's, and the
    other hosts a family names in ``Family.memory``).

    ``carries`` names the values a carried state enters and leaves by (``("state_input",
    "state_output")``): the decode pass feeds the first from the cache and taps the second. Without
    it the memory grows: it is the tokens so far of the host's value ``grows`` (where None, the
    attention's keys or values: ``name`` is ``"keys"`` or ``"values"``), the cached tokens concatenated
    before the new ones along ``past``. ``dims`` are layout dims after the batch; ``past`` is the
    number of cached tokens (0 before the first step)."""

    name: str
    dims: tuple[str, ...]
    carries: tuple[str, str] | None = None
    float32: bool = False  # kept in float32 whatever the model's dtype (a recurrent state)
    grows: str | None = None  # the host's value whose tokens so far it is (None: the attention's keys or values)
    # token ids (a long tensor) rather than activations: before the first step, every entry is this function of
    # the model's config (the id the model pads a prompt's history with); None: zeros
    fill_id: Callable[[Any], int] | None = None


@dataclass(frozen=True)
class Mixer:
    """A kind of token mixer a block can carry."""

    module: str  # the module a block of this kind carries, by its spec name ("linear_attn")
    title: str  # what diagrams and messages call it ("gated DeltaNet")
    memory: tuple[Memory, ...]  # what a decoding step carries, per block
    # what its heads write to the stream through: (the output projection, by spec name below the mixer, and
    # the layout dim counting the heads it reads), for per-head decompositions (qgraph.attribution)
    heads: tuple[str, str] | None = None

    @property
    def recurrent(self) -> bool:
        """Whether its memory is a carried state (not a growing key/value cache)."""
        return any(piece.carries for piece in self.memory)


@dataclass(frozen=True)
class RepeatedBlocks:
    """A block list whose blocks of one kind trace to the same graph: the export traces the first
    block of each kind and repeats it (``qgraph.export.repeat``)."""

    path: str  # the ModuleList's path in the model
    kinds_attribute: str | None  # the text config's list of block kinds; None when all blocks are alike
    image_only: bool = False  # only the image-text program runs them


@dataclass(frozen=True)
class Images:
    """An image-text model's image part: its inputs and export patches, and the vision tower's values,
    hosts, dims and blocks. ``Family.with_images`` adds it to a family, ``without_images`` removes it."""

    keys: tuple[str, ...]  # what a call takes beyond the text (the processor's outputs)
    inputs: tuple[str, ...]  # what the image-text program takes beyond the text inputs
    # (model, input_ids, attention_mask, **keys) -> {program input: tensor}, checked
    prepare: Callable[..., dict[str, torch.Tensor]]
    # (model) -> (example program inputs, their dynamic dims) for the export
    example: Callable[[torch.nn.Module], tuple[dict[str, torch.Tensor], dict[str, dict[int, Any]]]]
    patches: ExportPatches  # active while the image-text program is exported
    values: tuple[ValueSpec, ...]  # the vision tower's values (after every text value in the family's)
    hosts: dict[str, str]  # vision host kind -> module path template ({j}: vision block)
    dims: dict[str, DimSource]  # the vision tower's layout dims
    mixer: str  # the vision blocks' attention module, by its name in the block
    blocks: tuple[RepeatedBlocks, ...] = ()  # the vision blocks that trace alike (image_only)
    forward_kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of the exported forward
    # (config) -> {program input: what its dim 0 is always a multiple of}: the derived dims of ``example``
    # (patches = merge² × blocks), which the program's symbols lose where export takes them as Dim.DYNAMIC
    multiples: Callable[[Any], dict[str, int]] | None = None


@dataclass(frozen=True)
class Kernels:
    """The delta-rule kernels a family's DeltaNet calls: module-level functions, routed through
    qgraph's custom ops while exporting."""

    module: str  # the module whose functions they are
    chunk: str  # the chunked (prompt) kernel's function name
    recurrent: str  # the recurrent (one token) kernel's function name

    @property
    def functions(self) -> dict[str, str]:
        """Kernel kind ("chunk", "recurrent") -> function name in ``module``."""
        return {"chunk": self.chunk, "recurrent": self.recurrent}


@dataclass(frozen=True, eq=False)
class Family:
    """One model family: its value table and the facts the pipeline asks about its models. An
    image-text family is a text family ``with_images``: its values, hosts, dims and repeated blocks
    then include its image part's."""

    name: str
    model_types: tuple[str, ...]  # the text config's model_type values that load as this family
    classes: str  # the model classes, as messages name them
    values: tuple[ValueSpec, ...]  # the standard values and the rule that finds each
    hosts: dict[str, str]  # value host kind -> module path template ({i}: text block, {j}: vision block)
    mixers: dict[str, Mixer]  # block kind (an entry of the text config's block_kinds list) -> its mixer
    block_kinds: str  # the text config's attribute listing each block's kind
    dims: dict[str, DimSource]  # layout dim -> text config attribute, or a function of the model's config
    module_renames: tuple[tuple[str, str], ...]  # module path -> spec name; the first matching pattern renames
    no_ports: tuple[str, ...]  # the model itself and its wrappers: no ports, spec name ""
    readout: tuple[str, str]  # the final norm and the unembedding, by spec name
    rotary: str  # the text rotary's spec name (the decode pass feeds its position ids)
    position_rows: int  # rows of the position ids the rotary reads ([rows, batch, seq]; 3 for M-RoPE)
    kernels: Kernels  # the delta-rule kernels
    repeated_blocks: tuple[RepeatedBlocks, ...] = ()
    images: Images | None = None  # the image part, added by with_images
    export_patches: ExportPatches | None = None  # active while any program is exported
    # methods some transformers releases define on the model's classes that export cannot follow: while
    # exporting, a class that defines one runs the function given instead (compat.export_patches)
    export_methods: dict[str, Callable] = field(default_factory=dict)
    forward_kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of every exported forward
    check: Check | None = None
    # attributes a block's forward reads only to index a cache (the program is exported with none, and a
    # decode step's memory is its own inputs): a read of one bakes nothing, so blocks differing in it repeat
    cache_indices: tuple[str, ...] = ()
    # names other libraries give its values: a TransformerLens hook name ({i}: a text block) -> {host kind:
    # value name}, the value of the first host kind the block carries (a mixer's only on blocks with it);
    # values.names resolves them on a model, values.aliases without one (SAE, transcoder and capture files);
    # a value's first name is the one qgraph writes (HF module paths need none: module_renames renames them)
    aliases: dict[str, dict[str, str]] = field(default_factory=dict)
    # an alias this family's blocks lack -> what to use instead ({i}: the block, or the glob asked), ending
    # the message that refuses it (the MoE block's neurons for the dense MLP's hook_post)
    alias_instead: dict[str, str] = field(default_factory=dict)
    # the routed experts' down projection ([experts, hidden, inner]), by spec name below the MLP's host: each
    # expert's write to the stream, for per-expert decompositions (qgraph.attribution); None for a dense MLP
    experts_down: str | None = None
    # host kind -> the text blocks that carry it, where only some do (qwen4_exp's PLE on ple_layer_ids):
    # (config) -> block indices; a host kind not here is on every block (a mixer's on the blocks with it)
    host_blocks: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    # host kind -> what a decoding step carries for each host of that kind, beyond the blocks' mixers'
    # (qwen4_exp's PLE layers: the token ids its n-gram hashes read back, its dilated conv's left context)
    memory: dict[str, tuple[Memory, ...]] = field(default_factory=dict)
    # whether the rotary reads every token's position so far, the cached tokens' too (a cached step feeds it
    # them all, and the model slices the new tokens' itself: qwen4_exp's indexer rotates pooled blocks of
    # cached keys at their first token's position); False: the new tokens' alone
    rotary_reads_past: bool = False
    # whether export can take its batch and sequence dims as named ``Dim``s (which must hold for every size);
    # False: it traces with ``Dim.DYNAMIC`` dims at once (``compat.export``), where the named ones are known to
    # fail on a guard that does not change the values (said in the family, and its values tested at every length)
    named_dims: bool = True
    # why generate cannot run this family yet (what a decoding step would have to carry that qgraph does not),
    # said by ``generate`` before any work; None: it generates
    not_generating: str | None = None

    def __post_init__(self):
        part = self.images
        if part is None:
            return
        if not (all(spec in self.values for spec in part.values) and part.hosts.items() <= self.hosts.items()
                and part.dims.keys() <= self.dims.keys() and all(b in self.repeated_blocks for b in part.blocks)):
            raise InvalidArgument(f"family {self.name!r}: its image part's values, hosts, dims and blocks are not "
                                  f"all its own; build an image-text family with Family.with_images")

    @property
    def vision_mixer(self) -> str | None:
        """The vision blocks' attention module, by its name in the block (None without images)."""
        return self.images.mixer if self.images is not None else None

    def with_images(self, images: Images) -> Family:
        """This text family with the image part ``images``: its values after every text value, its
        hosts, dims and repeated blocks added."""
        if self.images is not None:
            raise InvalidArgument(f"family {self.name!r} already has images")
        return replace(self, values=(*self.values, *images.values), hosts={**self.hosts, **images.hosts},
                       dims={**self.dims, **images.dims}, repeated_blocks=(*self.repeated_blocks, *images.blocks),
                       images=images)

    def without_images(self) -> Family:
        """This family without its image part: no vision values, hosts, dims or image-only blocks."""
        part = self.images
        if part is None:
            return self
        return replace(self, values=tuple(spec for spec in self.values if spec not in part.values),
                       hosts={host: path for host, path in self.hosts.items() if host not in part.hosts},
                       dims={name: source for name, source in self.dims.items() if name not in part.dims},
                       repeated_blocks=tuple(b for b in self.repeated_blocks if b not in part.blocks), images=None)

    def with_host_values(self, host: str, values: tuple[ValueSpec, ...], *, hosts: dict[str, str] | None = None,
                         dims: dict[str, DimSource] | None = None, drop_dims: tuple[str, ...] = ()) -> Family:
        """This family with every value of ``host`` replaced by ``values``, placed where the first of
        them was; ``hosts`` (the new values' other host templates) and ``dims`` added, ``drop_dims`` dropped."""
        at = next((i for i, spec in enumerate(self.values) if spec.host == host), None)
        if at is None:
            raise InvalidArgument(f"family {self.name!r} has no values of host {host!r} to replace")
        unknown = set(drop_dims) - self.dims.keys()
        if unknown:
            raise InvalidArgument(f"family {self.name!r} has no dims {sorted(unknown)} to drop")
        kept = tuple(spec for spec in self.values[at:] if spec.host != host)
        return replace(self, values=(*self.values[:at], *values, *kept), hosts={**self.hosts, **(hosts or {})},
                       dims={**{name: source for name, source in self.dims.items() if name not in drop_dims},
                             **(dims or {})})

    def title(self, module: str) -> str:
        """What diagrams and messages call a mixer module (``gated DeltaNet``)."""
        return next((mixer.title for mixer in self.mixers.values() if mixer.module == module), module)

    # asked for every node's module scopes when locating values; the cache holds the family, harmless
    # here: a family is registered once and lives as long as the process
    @functools.cache  # noqa: B019
    def module_name(self, path: str) -> str:
        """The spec's name of a module path (``model.layers.3.mlp`` -> ``layers.3.mlp``); "" for the
        model itself and its wrappers (``model``, ``model.language_model``)."""
        if path in self.no_ports:
            return ""
        for pattern, replacement in self.module_renames:
            renamed, count = re.subn(pattern, replacement, path)
            if count:
                return renamed
        return path

    def ported_modules(self, model) -> list[tuple[str, str]]:
        """(path, spec name) of every module that gets ports (``<name>.input``/``.output``)."""
        return [(path, self.module_name(path)) for path, _ in model.named_modules() if path not in self.no_ports]

    def kinds(self, config) -> list[str]:
        """Each text block's kind (``linear_attention``, ``full_attention``), by block index."""
        text = config.get_text_config()
        return list(getattr(text, self.block_kinds)[: text.num_hidden_layers])

    def block_mixers(self, config) -> list[str]:
        """The mixer module each text block carries, by block index."""
        return [self.mixers[kind].module for kind in self.kinds(config)]

    def mixer(self, module: str) -> Mixer:
        """The mixer whose module is ``module``."""
        return next(mixer for mixer in self.mixers.values() if mixer.module == module)

    def vision_blocks(self, config) -> int:
        """How many blocks the vision tower has (0 for a text-only model)."""
        vision = getattr(config, "vision_config", None)
        return vision.depth if vision is not None and self.images is not None else 0

    def of_images(self, spec_host: str) -> bool:
        """Whether values of kind ``spec_host`` belong to the image-text part (the vision tower's)."""
        return self.images is not None and spec_host in self.images.hosts

    def hosts_of(self, spec_host: str, config) -> list[str]:
        """Every module path hosting values of kind ``spec_host`` on this model."""
        template = self.hosts[spec_host]
        if self.of_images(spec_host) and not self.vision_blocks(config):
            return []
        if "{i}" in template:
            mixers = self.block_mixers(config)
            is_mixer = spec_host in {mixer.module for mixer in self.mixers.values()}
            carried = self.host_blocks[spec_host](config) if spec_host in self.host_blocks else range(len(mixers))
            return [template.format(i=i) for i, mixer in enumerate(mixers)
                    if (not is_mixer or mixer == spec_host) and i in carried]
        if "{j}" in template:
            return [template.format(j=j) for j in range(self.vision_blocks(config))]
        return [template]

    def memory_hosts(self, config) -> list[tuple[str, Mixer]]:
        """(host, mixer) of every text block's mixer, in block order."""
        return [(self.hosts[self.mixers[kind].module].format(i=i), self.mixers[kind])
                for i, kind in enumerate(self.kinds(config))]

    def memories(self, config) -> list[tuple[str, Memory]]:
        """(host, piece) of every piece of memory a decoding step carries: each text block's mixer's, in
        block order, then the other hosts' (``memory``)."""
        return [*((host, piece) for host, mixer in self.memory_hosts(config) for piece in mixer.memory),
                *((host, piece) for kind, pieces in self.memory.items() for host in self.hosts_of(kind, config)
                  for piece in pieces)]

    def dim(self, config, name: str) -> int | None:
        """The size of a layout dim on this model (None for the call's own sizes, like ``seq``)."""
        source = self.dims.get(name)
        if source is None:
            return None
        return source(config) if callable(source) else getattr(config.get_text_config(), source)
