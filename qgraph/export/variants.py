"""Blocks that differ from their seed block are seeds of their own.

The seed export traces the first block of each kind and repeats its graph for every block of that
kind (``qgraph.export.repeat``). What the trace specialised on in the seed block would then stand
for all of them: the plain values its forward read, which ``torch.export`` bakes into the graph as
constants (a norm's eps, a gated norm's epsilon, an attention's scaling, a router's top-k: the
export's ``reads``, ``qgraph.export.constants``), its module classes and its parameters' shapes and
dtypes. A model whose blocks of one kind differ in any of these (a checkpoint that sets one block's
eps apart, a user who changed one block's value before or after ``instrument``) would get a program
that is silently wrong for the blocks unlike their seed.

``split(model, blocks, reads)`` compares every block with the first block of its kind, module by
module, nothing named by hand: each module's class, its own parameters' and buffers' shapes and
dtypes, and the value of every attribute in ``reads`` for its class (and for the class of a config
object the module holds). A block that differs starts a new *variant* of its kind: the seed export
traces it too (its own graph, with its own values baked in), and the blocks equal to it repeat
it. Values the forward does not read (a block's ``layer_idx`` under ``use_cache=False``) are not
reads and so never split blocks. The fingerprint check (``qgraph.export.fingerprint``) reads the
same values on every block, so a value changed after ``instrument`` rebuilds the program, split anew.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .constants import class_name
from .repeat import Blocks

Signature = dict[tuple[str, str], str]  # (module path in the block, what) -> its value, as text


def split(model: torch.nn.Module, blocks: Blocks, reads) -> Blocks:
    """``blocks`` with each block's variant of its kind: 0 for the blocks equal to their kind's first
    block, 1, 2, ... for each other set of equal blocks (every variant is traced apart), and why."""
    by_class: dict[str, list[str]] = {}
    for owner, attribute in sorted(reads):
        by_class.setdefault(owner, []).append(attribute)
    found: dict[str, list[tuple[tuple, int, Signature]]] = {}  # kind -> (signature, first block, its values)
    variants, apart = [], []
    for index, kind in enumerate(blocks.kinds):
        values = signature(model.get_submodule(f"{blocks.path}.{index}"), by_class)
        key = tuple(sorted(values.items()))
        known = found.setdefault(kind, [])
        variant = next((number for number, (seen, _, _) in enumerate(known) if seen == key), None)
        if variant is None:
            variant = len(known)
            known.append((key, index, values))
            if variant:
                apart.append(_why(f"{blocks.path}.{index}", values, known[0][1], known[0][2]))
        variants.append(variant)
    return replace(blocks, variants=tuple(variants) if any(variants) else (), apart=tuple(apart))


def signature(block: torch.nn.Module, by_class: dict[str, list[str]]) -> Signature:
    """What the trace of ``block`` specialises on, per module path in it (see the module doc)."""
    values: Signature = {}
    for path, module in block.named_modules():
        values[(path, "class")] = class_name(type(module))
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            values[(path, name)] = f"{tuple(tensor.shape)} {tensor.dtype}"
        for attribute in by_class.get(class_name(type(module)), ()):
            values[(path, attribute)] = _text(getattr(module, attribute, "<unset>"))
        config = module.__dict__.get("config")
        for attribute in by_class.get(class_name(type(config)), ()) if config is not None else ():
            values[(f"{path}.config" if path else "config", attribute)] = _text(getattr(config, attribute, "<unset>"))
    return values


def _text(value) -> str:
    """A read value as the signature holds it: a submodule by its class (its own parts are compared at its
    own path), anything else by its repr."""
    return class_name(type(value)) if isinstance(value, torch.nn.Module) else repr(value)


def _why(path: str, values: Signature, first: int, first_values: Signature) -> str:
    """One line: the first value in which block ``path`` differs from block ``first``, its kind's first."""
    for key in sorted(values.keys() | first_values.keys()):
        here, there = values.get(key, "<none>"), first_values.get(key, "<none>")
        if here != there:
            module, what = key
            where = f"{path}.{module}" if module else path
            return f"{where}: {what} is {here} where block {first}'s (its kind's first) is {there}"
    return f"{path} differs from block {first}"
