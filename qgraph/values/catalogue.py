"""The values of one model: every standard value on every host, and every module port.

``build_catalogue`` turns a family's ``VALUES`` into concrete names (``layers.3.self_attn.attention_gate``),
each with its layout, its shape and where the locator found it (or why it could not).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import sympy

from .. import compat
from ..families import Family
from ..families.rules import Derived, ProgramInput, ValueSpec
from .locate import Found, Locator, Missing, OnRequest


@dataclass(frozen=True)
class Entry:
    """One concrete value of one model."""

    name: str  # "layers.3.self_attn.attention_gate", "layers.3.mlp.down_proj.input"
    host: str  # the module that hosts it ("" for the model itself)
    layout: str  # "HeadOutputs [batch seq num_heads head_dim]"
    shape: tuple  # the layout's dims with the config's sizes filled in, ints or names: ("batch", "seq", 4, 32)
    description: str
    location: Found | OnRequest | Missing
    spec: ValueSpec | None = None  # None for a module port

    @property
    def available(self) -> bool:
        return isinstance(self.location, (Found, OnRequest)) or self.derived

    @property
    def found(self) -> Found:
        """Where the program holds it, for a value known to be there: one a build asked for, once its passes
        made it (``passes.make.MakeOnRequest``), or one checked to be found."""
        assert isinstance(self.location, Found), f"'{self.name}' is not a node of the program: {self.location}"
        return self.location

    @property
    def derived(self) -> bool:
        return self.spec is not None and self.spec.rule.derived

    @property
    def by_name_only(self) -> bool:
        """Whether only its own name selects the value, never a glob: the DeltaNet values that
        rewrite their block when asked for (``states``, large, and ``state``, which needs positions,
        swap its kernel; the conv states open its conv), so a glob never changes the program: the
        rule's ``by_name_only`` trait."""
        return self.spec is not None and self.spec.rule.by_name_only

    @property
    def derivation(self) -> Derived:
        """The rule of a derived value (``derived``): how it is computed, and from which values."""
        rule = self.spec.rule if self.spec is not None else None
        assert isinstance(rule, Derived), f"'{self.name}' is not a derived value"
        return rule

    @property
    def read_only(self) -> bool:
        return self.spec is not None and self.spec.read_only

    @property
    def reason(self) -> str | None:
        return self.location.reason if isinstance(self.location, Missing) and not self.derived else None

    @property
    def port(self) -> bool:
        """Whether it is a module's input or output (only a pattern that asks for ports selects it)."""
        return self.spec is None

    @property
    def dims(self) -> tuple[str, ...]:
        """Its axes' names (``("batch", "seq", "num_heads", "head_dim")``); a port's, its sizes."""
        return tuple(str(dim) for dim in (self.spec.dims if self.spec is not None else self.shape))

    @property
    def availability(self) -> str:
        """Whether (and how) a program can serve it, in words."""
        if self.derived:
            return "yes: computed after the run from other values"
        if isinstance(self.location, Found):
            return "yes"
        if isinstance(self.location, OnRequest):
            return f"yes, made on request: {self.location.rewrite.note}"
        return f"no: {self.reason}"


# what an entry says as data (a server's /v1/info, a saved program): every fact but where the graph has it
FACTS = ("host", "layout", "dims", "shape", "description", "port", "by_name_only", "available", "reason",
         "availability")


def entry_data(entry) -> dict:
    """The facts of ``entry`` as JSON data (``ServedEntry`` reads them back)."""
    data = {fact: getattr(entry, fact) for fact in FACTS}
    data["dims"], data["shape"] = list(entry.dims), [s if isinstance(s, int) else str(s) for s in entry.shape]
    return data


@dataclass(frozen=True)
class ServedEntry:
    """A value of a model that runs elsewhere (a server, a saved program): the facts ``entry_data`` sends,
    read by the same functions as a local ``Entry`` (``values.names.resolve``, the recipes, the pictures)."""

    name: str
    host: str
    layout: str
    dims: tuple
    shape: tuple
    description: str
    port: bool
    by_name_only: bool
    available: bool
    reason: str | None
    availability: str
    derived = False
    read_only = False

    @classmethod
    def of(cls, name: str, data: dict) -> ServedEntry:
        return cls(name, **{**data, "dims": tuple(data["dims"]), "shape": tuple(data["shape"])})


def build_catalogue(family: Family, config, locator: Locator, module_names: list[str]) -> dict[str, Entry]:
    """Every value of the model: the model's, then block by block, then the vision tower's, then ports."""
    placed = []
    # each host kind's hosts and each dim's size read once (a config attribute read is slow in transformers)
    hosts = functools.cache(lambda kind: family.hosts_of(kind, config))
    sizes = functools.cache(lambda dim: _spec_size(family, config, dim))
    for order, spec in enumerate(family.values):
        for host in hosts(spec.host):
            name = f"{host}.{spec.name}" if host else spec.name
            shape = tuple(sizes(dim) for dim in spec.dims)
            location = Missing("derived") if spec.rule.derived else locator.locate(host, spec.rule)
            block = re.search(r"layers\.(\d+)", host)
            section = 2 if family.of_images(spec.host) else (1 if block else 0)
            placed.append(((section, int(block.group(1)) if block else -1, order),
                           Entry(name, host, spec.layout, shape, spec.description, location, spec)))
    entries = {entry.name: entry for _, entry in sorted(placed, key=lambda item: item[0])}

    symbols, whole = _symbol_names(locator), _whole_units(family, config, locator)
    size_of = functools.cache(lambda size: port_size(size, symbols, whole))  # by expression: printing one is slow
    for module in module_names:
        for side in ("input", "output"):
            name = f"{module}.{side}"
            marker = locator.ports.get(name)
            if marker is None:
                entries[name] = Entry(name, module, "", (), f"the {side} of {module}", Missing(
                    f"module '{module}' is never called as a module in the forward (its weights are used "
                    f"directly), so it has no {side}"))
                continue
            shape = tuple(size_of(compat.size_expression(size)) for size in marker.meta["val"].shape)
            layout = "[" + " ".join(str(size) for size in shape) + "]"
            entries[name] = Entry(name, module, layout, shape, f"the {side} of {module}", Found(marker))
    return entries


def _spec_size(family: Family, config, dim: str) -> int | str:
    """A layout dim's size on this model: an int (a number in the layout, or the config's size), or the
    dim's name where the call sets it (``batch``, ``seq``)."""
    if dim.isdigit():
        return int(dim)
    size = family.dim(config, dim)
    return dim if size is None else int(size)


def port_size(size, symbols, whole: dict | None = None) -> int | str:
    """One size of a port's traced tensor: an int, also where the trace holds a symbol that is one number
    (a SymInt specialised to ``128`` prints as ``'128'``) or an expression that is one number once each
    symbol of ``whole`` is the multiple it always is (``32*(s15//(s15//4))`` with ``s15`` four patches a
    unit: 128), else its expression in the call's dims (``symbols``: ``4*s43*s53`` -> ``4*batch*seq``)."""
    if isinstance(size, int):
        return size
    if whole:
        value = compat.size_expression(size).xreplace(whole)
        if getattr(value, "is_Integer", False):
            return int(value)
    text = str(size)
    return int(text) if re.fullmatch(r"-?\d+", text) else symbols(text)


def _symbol_names(locator: Locator):
    """A function naming the program's symbolic sizes after the call's dims (``4*s43*s53`` -> ``4*batch*seq``)."""
    input_ids = locator.locate("", ProgramInput("input_ids"))
    assert isinstance(input_ids, Found), f"every exported program takes input_ids: {input_ids}"
    batch, seq = input_ids.node.meta["val"].shape
    names = {str(batch): "batch", str(seq): "seq"}
    return lambda size: re.sub(r"\bs\d+\b", lambda m: names.get(m.group(0), m.group(0)), size)


def _whole_units(family: Family, config, locator: Locator) -> dict:
    """Each program symbol that is a multiple of a unit (``Images.multiples``: the patches, of merge² each) ->
    that multiple of a fresh positive symbol. The program's symbols say it where export kept the derived
    dim (``4*s5``); where it took the dims as ``Dim.DYNAMIC`` (``compat.export_dims``: torch up to 2.12)
    the patches are a free ``s15`` and a size such as the merged patches' width is ``32*(s15//(s15//4))``."""
    images = family.images
    if images is None or images.multiples is None:
        return {}
    whole = {}
    for name, multiple in images.multiples(config).items():
        found = locator.locate("", ProgramInput(name))
        if isinstance(found, Found):
            expression = compat.size_expression(found.node.meta["val"].shape[0])
            if getattr(expression, "is_Symbol", False):
                whole[expression] = multiple * sympy.Dummy(f"{name}_units", integer=True, positive=True)
    return whole
