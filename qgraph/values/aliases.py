"""TransformerLens hook names read without a model: the registered families' alias table
(``Family.aliases``) where no model is known yet, and back to a hook name where qgraph writes files
other libraries read.

An SAE's or a transcoder's file names the hook it was trained on, and is read before it meets a model
(``SAE.load``, ``Transcoder.load``, ``CrossLayerTranscoder.load``); a capture names its SAELens columns
by hook. Without a model's config, a hook reads only where its value's host is on every block (the
block, its MLP) or the model's: which mixer a block carries, and so ``hook_attn_out``, only the config
says. On a model, ``names.standard`` reads the same table, mixers included.
"""
from __future__ import annotations

import re

from ..errors import InvalidArgument
from ..families import FAMILIES, Family

BLOCK = "blocks.{i}."  # TransformerLens's prefix of a block's hooks


def tl_split(hook: str) -> tuple[int | None, str]:
    """``blocks.5.mlp.hook_in`` -> ``(5, "mlp.hook_in")``; a name naming no block -> ``(None, name)``."""
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)", hook)
    return (int(match[1]), match[2]) if match else (None, hook)


def tl_value(hook: str, block: int | None = None) -> str | None:
    """The qgraph value a TransformerLens hook name is: ``blocks.5.hook_resid_post`` ->
    ``layers.5.layer_output``, ``hook_mlp_in`` with ``block=3`` -> ``layers.3.layer_mid``, ``hook_embed``
    -> ``token_embeddings``. A block's hook with no block, named or given, is its value's name within a
    block (``hook_mlp_out`` -> ``mlp.mlp_output``), for a file that names its block elsewhere or applies
    to every block. None where no registered family reads it without a model (an unknown hook, a mixer's),
    or where their tables disagree."""
    named, name = tl_split(hook)
    if None not in (named, block) and named != block:
        raise InvalidArgument(f"'{hook}' is a hook of block {named}, not of block={block}")
    in_block, block = named is not None, named if named is not None else block
    found = {value for family in FAMILIES if (value := _value(family, name, in_block, block))}
    return found.pop() if len(found) == 1 else None


def tl_names(value: str) -> list[str]:
    """Every TransformerLens hook name of a qgraph value in the registered families' tables, in table
    order (the first is the one to write): ``layers.3.layer_mid`` -> ``[blocks.3.hook_resid_mid,
    blocks.3.hook_mlp_in]``; a value named within a block, ``layer_mid``, -> the hooks' names within a
    block, ``[hook_resid_mid, hook_mlp_in]``. [] where no table names it."""
    found = {hook: None for family in FAMILIES for template, hosts in family.aliases.items()
             for host, name in hosts.items() if _has(family, host, name)
             and (hook := _hook(template, family.hosts[host], name, value))}
    return list(found)


def _value(family: Family, name: str, in_block: bool, block: int | None) -> str | None:
    """``name``'s value in ``family``'s table: the first of its hosts with that value, None where that
    host is a mixer (it depends on the block) or none has it."""
    templates = (BLOCK + name,) if in_block else (name, BLOCK + name)
    hosts = next((family.aliases[template] for template in templates if template in family.aliases), {})
    mixers = {mixer.module for mixer in family.mixers.values()}
    for host, value in hosts.items():
        if host in mixers:
            return None
        if _has(family, host, value):
            return _render(family.hosts[host], value, block)
    return None


def _has(family: Family, host: str, value: str) -> bool:
    """Whether ``family`` has the value ``value`` on hosts of kind ``host`` (text blocks or the model's)."""
    return "{j}" not in family.hosts[host] and any(spec.host == host and spec.name == value for spec in family.values)


def _render(template: str, value: str, block: int | None) -> str:
    """A host's ``value`` by name: on ``block``, or (None) within a block, its path after the block's."""
    if "{i}" in template:
        template = template.format(i=block) if block is not None else template.split("{i}", 1)[1]
    return f"{template}.{value}".lstrip(".")


def _hook(template: str, host: str, name: str, value: str) -> str | None:
    """The hook name ``template`` gives ``value``, where ``value`` is the value ``name`` on the host at
    ``host`` (a path template), by its name or within a block; else None."""
    if value == _render(host, name, None):  # the model's value, or a block's within a block
        return template.removeprefix(BLOCK)
    match = re.fullmatch(re.escape(f"{host}.{name}").replace(re.escape("{i}"), r"(\d+)"), value)
    return template.format(i=match[1]) if match and "{i}" in host else None
