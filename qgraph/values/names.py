"""Value names as users write them: globs, the bracket form, the names people bring from other libraries
(TransformerLens hook names, HF module paths), and errors that say what to write."""
from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterable, Mapping

import torch

from ..errors import InvalidType, UnavailableValue, UnknownValue
from .catalogue import Entry, ServedEntry


def _dotted(name: str) -> str:
    return re.sub(r"\[(-?\d+|\*)\]", r".\1", name.strip())


def normalize(name: str) -> str:
    """``layers[3].self_attn.x`` and ``model.layers.3.self_attn.x`` -> ``layers.3.self_attn.x``."""
    name = _dotted(name)
    return name[len("model."):] if name.startswith("model.") else name


def canonical(name: str, blocks: int, aliases=None) -> str:
    """The catalogue spelling of a name: dotted, no ``model.`` prefix, non-negative block index.
    ``aliases`` (``aliases(family, config)``) reads the names people bring too (``blocks.3.hook_resid_post``)."""
    if aliases is not None:
        try:
            spelled = aliases(name)
        except UnknownValue:  # a hook the block lacks: not a name anything is kept under
            spelled = []
        if len(spelled) == 1:
            return spelled[0]
    return _positive_block(normalize(name), blocks)


def aliases(family, config):
    """``name -> [standard names]`` on a model of ``family`` (``standard``), for ``canonical``."""
    return functools.partial(standard, family=family, config=config)


def standard(raw: str, family, config) -> list[str]:
    """The catalogue spellings of a name as people bring it. An HF module path is renamed as the family
    renames module paths (``model.language_model.layers.3.mlp.output`` -> ``layers.3.mlp.output``); a
    TransformerLens hook name (``family.aliases``) is the value it means (``blocks.3.hook_resid_post`` ->
    ``layers.3.layer_output``), one per block for a glob over blocks (``blocks.*.hook_attn_out``: every
    block's mixer's output), anything after it kept (``blocks.1.hook_resid_post.sae.features``); a hook
    the block lacks raises UnknownValue naming what the block has. Other names: ``[canonical(raw)]``."""
    blocks = len(family.kinds(config))
    name = _dotted(raw)
    name = family.module_name(name) or name
    for template in sorted(family.aliases, key=len, reverse=True):
        match = _alias_pattern(template).match(name)
        if match is None:
            continue
        hosts, rest, block = family.aliases[template], match["rest"] or "", match.groupdict().get("block")
        if block is None:  # a model-level hook
            found = _alias_value(family, config, hosts, None)
            return [found + rest] if found else [canonical(name, blocks)]
        if "*" not in block and "?" not in block:
            index = int(block)
            if not -blocks <= index < blocks:
                raise UnknownValue(f"'{raw}': there is no block {index}; the model has blocks 0 to {blocks - 1}.")
            found = _alias_value(family, config, hosts, index % blocks)
            if found is None:
                raise UnknownValue(_lacking(raw, template, hosts, index % blocks, family, config)
                                   + _instead(family, template, str(index % blocks)))
            return [found + rest]
        each = [_alias_value(family, config, hosts, i) for i in range(blocks) if _glob(block).match(str(i))]
        if not any(each):
            raise UnknownValue(f"'{raw}' selects no value: {_meaning(template, hosts, family, config)}"
                               + _instead(family, template, block))
        return [value + rest for value in each if value]
    return [canonical(name, blocks)]


@functools.cache
def _alias_pattern(template: str) -> re.Pattern:
    block = r"(?P<block>-?\d+|[\d*?]+)"
    return re.compile(block.join(map(re.escape, template.split("{i}"))) + r"(?P<rest>\..+)?\Z")


def _alias_value(family, config, hosts: dict[str, str], block: int | None) -> str | None:
    """The standard name an alias's ``hosts`` ({host kind: value}) give on ``block`` (None: the model's),
    from the first host kind the block has (a mixer's only on its blocks) with that value; else None."""
    mixers = {mixer.module for mixer in family.mixers.values()}
    carried = family.block_mixers(config)[block] if block is not None else None
    for host, value in hosts.items():
        if (host in mixers and host != carried) or not any(s.host == host and s.name == value for s in family.values):
            continue
        path = family.hosts[host].format(i=block)
        return f"{path}.{value}" if path else value
    return None


def _meaning(template: str, hosts: dict[str, str], family, config) -> str:
    blocks = [i for i in range(len(family.kinds(config))) if _alias_value(family, config, hosts, i)]
    means = " or ".join(".".join(filter(None, (family.hosts[host], value))) for host, value in hosts.items())
    return (f"{template} is {means}, which blocks {blocks} have." if blocks else
            f"{template} is {means}, which {family.classes} models do not have.")


def _instead(family, template: str, block: str) -> str:
    """`` <what to use instead>`` of an alias the family's blocks lack (``family.alias_instead``), for
    ``block`` (a number, or the glob asked); "" where the family names nothing."""
    instead = family.alias_instead.get(template)
    return f" {instead.format(i=block).rstrip('.')}." if instead else ""


def _lacking(raw: str, template: str, hosts: dict[str, str], block: int, family, config) -> str:
    """Why block ``block`` has no value for an alias: what kind of block it is, and what its mixer has."""
    mixer, kind = family.block_mixers(config)[block], family.kinds(config)[block]
    what = next((spec for spec in family.values if (spec.host, spec.name) in hosts.items()), None)
    if what is None or what.host not in {m.module for m in family.mixers.values()}:  # not the block's kind
        return f"'{raw}': {_meaning(template, hosts, family, config)}"
    lacks = f"no {what.name} ({what.description.lower()})"
    has = ", ".join(spec.name for spec in family.values if spec.host == mixer)
    return (f"'{raw}': block {block} is a {family.title(mixer)} block ({kind}) with {lacks}: "
            f"{_meaning(template, hosts, family, config)} Its {family.title(mixer)} "
            f"{family.hosts[mixer].format(i=block)} has {has}.")


def _positive_block(name: str, blocks: int) -> str:
    """``layers.-1.x`` -> ``layers.{blocks - 1}.x``, as Python indexes a list."""
    return re.sub(r"^layers\.(-\d+)(?=\.|$)",
                  lambda m: f"layers.{blocks + int(m.group(1))}" if -int(m.group(1)) <= blocks else m.group(0), name)


def _glob(pattern: str) -> re.Pattern:
    # ``*`` stays inside one dotted part (so ``layers.*.linear_attn.*`` means standard values, not
    # every submodule's ports); ``**`` crosses parts.
    parts = re.split(r"(\*\*|\*|\?)", pattern)
    wild = {"**": ".*", "*": "[^.]*", "?": "[^.]"}
    return re.compile("".join(wild.get(part) or re.escape(part) for part in parts) + r"\Z")


def matching(pattern: str, names, blocks: int) -> list[str]:
    """The ``names`` that one user pattern (a name, glob or bracket form) selects, in their order."""
    regex = _glob(canonical(pattern, blocks))
    return [name for name in names if regex.match(name)]


def patterns_of(patterns) -> list[str]:
    """``patterns`` as a list of name strings: None is none, a string is one name (never its
    characters), a dict gives its keys; anything else that is not a name raises a TypeError."""
    if patterns is None:
        return []
    if isinstance(patterns, str):
        return [patterns]
    if isinstance(patterns, (bytes, torch.Tensor)) or not isinstance(patterns, Iterable):
        raise InvalidType(f"{type(patterns).__name__} {patterns!r} is not a value name or a list of them: give names "
                          f"as strings, e.g. ['layers.*.layer_output', 'layers.3.mlp.mlp_neurons'] "
                          f"(values= also takes a dict {{name: options}})")
    patterns = list(patterns)  # a dict gives its keys
    bad = [pattern for pattern in patterns if not isinstance(pattern, str)]
    if bad:
        raise InvalidType(f"{', '.join(f'{type(b).__name__} {b!r}' for b in bad)}: not a value name; names are "
                          f"strings, e.g. 'layers.3.layer_output' (block 3) or 'layers.*.layer_output' (every block)")
    return patterns


def resolve(patterns, catalogue: Mapping[str, Entry | ServedEntry], family, config) -> list[str]:
    """The concrete, available value names that ``patterns`` select, in catalogue order.

    An exact name must exist and be available; a glob must select at least one available value
    (it skips the unavailable ones it also matches).
    """
    selected: dict[str, None] = {}
    for raw, pattern in ((given, pattern) for given in patterns_of(patterns)
                         for pattern in standard(given, family, config)):
        if "*" in pattern or "?" in pattern:
            regex = _glob(pattern)
            # a module's ports are matched only by a pattern that asks for ports (or crosses parts)
            ports_too = "**" in pattern or pattern.rsplit(".", 1)[-1] in ("input", "output", "*put")
            # ... and a value that rewrites its block (Entry.by_name_only) only by a pattern that
            # names it in its last part (layers.*.linear_attn.states, not layers.*.linear_attn.*)
            last = pattern.rsplit(".", 1)[-1]
            matches = [name for name in catalogue if regex.match(name)
                       and (not catalogue[name].by_name_only or name.rsplit(".", 1)[-1] == last)
                       and (ports_too or not catalogue[name].port)]
            available = [name for name in matches if catalogue[name].available]
            if not available:
                if matches:
                    reasons = sorted(filter(None, {catalogue[name].reason for name in matches}))
                    raise UnavailableValue(f"'{raw}' matches only unavailable values: " + "; ".join(reasons))
                raise UnknownValue(_unknown_message(raw, pattern, catalogue, family, config))
            selected.update(dict.fromkeys(available))
            continue
        entry = catalogue.get(pattern)
        if entry is None:
            raise UnknownValue(_unknown_message(raw, pattern, catalogue, family, config))
        if not entry.available:
            raise UnavailableValue(f"'{raw}' is unavailable: {entry.reason}")
        selected[pattern] = None
    return list(selected)


def _unknown_message(raw: str, pattern: str, catalogue: Mapping[str, Entry | ServedEntry], family,
                     config) -> str:
    block_mixers = family.block_mixers(config)
    if not family.vision_blocks(config) and pattern.split(".")[0] in ("vision", "projector"):
        return (f"'{raw}': this model has no vision encoder (it is text-only); vision values need the image-text "
                f"model (one of {family.classes})")
    wrong_kind = re.match(r"layers\.(-?\d+)\.(\w+)", pattern)
    if wrong_kind:
        block, module = int(wrong_kind.group(1)), wrong_kind.group(2)
        if not -len(block_mixers) <= block < len(block_mixers):
            return f"'{raw}': there is no block {block}; the model has blocks 0 to {len(block_mixers) - 1}."
        mixers = set(block_mixers)
        if module in mixers and block_mixers[block] != module:
            kind = f"{family.kinds(config)[block]} ({family.title(block_mixers[block])})"
            blocks = [i for i, mixer in enumerate(block_mixers) if mixer == module]
            return (f"'{raw}': block {block} is a {kind} block: its mixer is layers.{block}.{block_mixers[block]}, "
                    f"not {module}. Blocks with {module}: {blocks}.")
    if family.aliases and (pattern.startswith("blocks.") or pattern.startswith("hook_")):
        return (f"Unknown value '{raw}'. The TransformerLens names qgraph reads: {', '.join(family.aliases)} "
                f"(see qgraph.support(model) for qgraph's own names).")
    closest = difflib.get_close_matches(pattern, list(catalogue), n=5, cutoff=0.5)
    hint = ("Closest names: " + ", ".join(closest)) if closest else "See qgraph.support(model) for every name."
    return f"Unknown value '{raw}'. {hint}"
