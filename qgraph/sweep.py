"""Activation patching sweeps that reuse the prefix: ``qgraph.patch`` location by location.

Patching one location of block ``k`` leaves blocks ``0..k-1`` as the corrupt run computed them, yet a
plain loop runs them again for every location. A sweep instead cuts the patching program at every
block boundary (``distributed.split``, as ``stages=`` cuts it), runs ``corrupt`` through the stages
once, keeping what each stage hands on, and for each location runs only the stages from its value's
block on, from what the corrupt run handed them. The locations of one value run together, stacked
along the batch: rows ``l * batch .. (l + 1) * batch`` (the corrupt input, repeated) patch location
``l``, so one pass of the suffix serves many locations (a matrix product of many rows costs little
more than one of few where reading the weights dominates). A location is a position and/or a head of
the value, or the whole value; its edit replaces it with the clean run's value there, as
``Replace(clean[..., p, ...], positions=[p])`` would.
"""
from __future__ import annotations

import re
import weakref

import torch

from .distributed import blocks_of
from .distributed.split import pick, split
from .edit_checks import indices
from .edits import AXES, Region, Replace
from .errors import InternalError, InvalidArgument, InvalidType
from .inputs import prepare, vision_given
from .passes.edit import applying
from .progress import progress

LOGITS_BUDGET = 2**27  # logits elements one pass may hold by default (512 MiB of float32)
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # built Program -> its Plan, cut once


def sweep(instrumented, clean: dict, corrupt: dict, names: list[str], metric, positions=None, heads=None,
          batch_size: int | None = None) -> dict:
    """``{name: metric values}`` of patching each location of each of ``names`` (``qgraph.patch``)."""
    capture = instrumented.variant(names)
    patcher = instrumented.variant((), edits=names)
    with torch.no_grad():
        clean_values = capture(**clean).values
        run = CorruptRun(patcher, corrupt)
        with progress("qgraph: patching", total=len(names), unit="value") as bar:
            results = {}
            for name in names:
                results[name] = run.patch(name, clean_values[name], metric, positions, heads, batch_size)
                bar.update()
    return results


def patch_by_calls(instrumented, clean: dict, corrupt: dict, names: list[str], metric, positions=None, heads=None,
                   concurrent: int = 1) -> dict:
    """What ``sweep`` returns, each location one call of ``instrumented`` on ``corrupt`` with a ``Replace``
    of that location by its clean value (``concurrent`` calls at once): the patching of an instrument
    whose program this process cannot cut (a remote one, whose server batches the calls; a loaded one)."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415 — only this way of patching uses threads

    with torch.no_grad():
        clean_values = instrumented.variant(names)(**clean).values
    patcher = instrumented.variant((), edits=names)
    results = {}
    for name in names:
        entry, value = instrumented.catalogue[name], clean_values[name]
        axes, chosen, spots = spots_of(list(entry.dims), value.shape, positions, heads, name, entry.layout)

        def one(spot, name=name, value=value, axes=axes):
            index, region = [slice(None)] * value.dim(), {}
            for what, at in zip(("positions", "heads"), spot):
                if at is not None:
                    index[axes[what]], region[what] = [at], [at]
            edit = Replace(value[tuple(index)].contiguous(), **region)
            with torch.no_grad():
                return metric(patcher(**corrupt, edits={name: edit}).logits)

        with ThreadPoolExecutor(concurrent) as pool:
            results[name] = stacked(list(pool.map(one, spots)), chosen, positions, heads, name)
    return results


class CorruptRun:
    """The corrupt input run through the patching program's stages once, and the suffix runs from it."""

    def __init__(self, patcher, corrupt: dict):
        patcher.refresh()
        inputs = dict(corrupt)
        images = patcher.exported.images and vision_given(inputs)
        ids, mask = inputs.pop("input_ids", None), inputs.pop("attention_mask", None)
        prepared = prepare(patcher.model, patcher.family.images, ids, mask, with_images=images, **inputs)
        self.patcher, self.program = patcher, patcher.program_for(images)
        self.plan = _plan(self.program)
        self.args = self.program.arguments(prepared)
        self.rows = prepared["input_ids"].shape[0]
        self.metas = [[node.meta.get("val") for node in module.graph.find_nodes(op="placeholder")]
                      for module in self.plan.modules]
        ids_meta = self.program.graph.find_nodes(op="placeholder")[self.program.input_names.index("input_ids")]
        batch = ids_meta.meta["val"].shape[0]
        # the batch's symbol in the program's shapes (None if the batch is not dynamic: no stacking then)
        self.batch = None if isinstance(batch, int) else re.compile(rf"\b{re.escape(str(batch))}\b")
        self.produced = self._stages(0, 1, [])
        kind, *where = self.plan.outputs[0]  # the logits (the patcher returns them first)
        self.logits_size = pick(self.produced[where[0]], where[1]).numel()

    def patch(self, name: str, clean: torch.Tensor, metric, positions, heads, batch_size) -> object:
        """Metric values of patching each location of ``name`` with ``clean`` (``sweep``)."""
        slot = self.program.slots[name]
        dims = list(slot.target.dims)
        found, chosen, spots = spots_of(dims, clean.shape, positions, heads, name, slot.target.layout)
        axes = {"batch": axis_of(dims, "batch"), **found}
        per_pass = 1 if axes["batch"] is None or self.batch is None else \
            batch_size or max(1, LOGITS_BUDGET // self.logits_size)
        start = self._stage_of(slot)
        values = []
        for first in range(0, len(spots), per_pass):
            chunk = spots[first:first + per_pass]
            with applying({slot: _PatchEdit(clean, chunk, axes, self.rows)}):
                logits = self._logits(start, len(chunk))
            values += [metric(part) for part in logits.split(self.rows)]
        return stacked(values, chosen, positions, heads, name)

    def _stage_of(self, slot) -> int:
        for index, module in enumerate(self.plan.modules):
            if any(child is slot for child in module.modules()):
                return index
        raise InternalError(f"patch: the slot of '{slot.target.name}' is in no stage of the cut program")

    def _stages(self, start: int, copies: int, handed: list) -> list:
        """Run stages ``start..`` on ``copies`` copies of the corrupt batch: what stages before ``start``
        ``handed`` on (and the batched program inputs) repeated ``copies`` times along the batch."""
        produced = list(handed[:start]) + [None] * (len(self.plan) - start)
        for index in range(start, len(self.plan)):
            inputs = []
            for (kind, *where), meta in zip(self.plan.inputs[index], self.metas[index]):
                value = self.args[where[0]] if kind == "input" else pick(produced[where[0]], where[1])
                handed = kind == "input" or where[0] < start
                inputs.append(self._repeat(value, meta, copies) if handed and copies > 1 else value)
            produced[index] = self.plan.modules[index](*inputs)
        return produced

    def _logits(self, start: int, copies: int) -> torch.Tensor:
        kind, *where = self.plan.outputs[0]
        return pick(self._stages(start, copies, self.produced)[where[0]], where[1])

    def _repeat(self, value, meta, copies: int):
        """``value`` for ``copies`` copies of the batch: repeated along its batch axis (its leading one)."""
        batch = self.batch
        assert batch is not None, "copies of the batch are stacked only where it is dynamic (patch's per_pass)"
        if not isinstance(meta, torch.Tensor):
            if batch.search(str(meta)):
                raise InternalError(f"patch: a size of the batch ({meta}) crosses a block boundary; the sweep cannot "
                                    f"stack locations along the batch")
            return value
        dims = [str(size) for size in meta.shape]
        if dims and batch.fullmatch(dims[0]):
            return value.repeat(copies, *[1] * (value.dim() - 1))
        if any(batch.search(dim) for dim in dims):
            raise InternalError(f"patch: a tensor of shape {tuple(meta.shape)} crosses a block boundary with the batch "
                                f"in a later axis; the sweep cannot stack locations along the batch")
        return value


class _PatchEdit(Region):
    """The per-call edit of one pass: rows ``l * rows .. (l + 1) * rows`` get the clean value at
    location ``l`` of ``chunk`` (a position and/or head; None: every one), the rest stay corrupt. A
    region edit (a ``Region``: whole positions and heads replaced), so it reaches values edited inside
    a kernel (``write_values``) too."""

    def __init__(self, clean: torch.Tensor, chunk: list[tuple], axes: dict, rows: int):
        self.clean, self.chunk, self.axes, self.rows = clean, chunk, axes, rows

    def apply(self, x: torch.Tensor, target, forward=None) -> torch.Tensor:
        return self(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        batch, copies = self.axes["batch"], len(self.chunk)
        source = self.clean if batch is None else \
            self.clean.repeat(*[copies if axis == batch else 1 for axis in range(self.clean.dim())])
        if source.shape != x.shape:
            raise InvalidArgument(f"patch: the clean value {tuple(self.clean.shape)} does not fit the corrupt run's "
                                  f"{tuple(x.shape)}: give clean and corrupt inputs of the same shape")
        shape = [size if axis in self.axes.values() else 1 for axis, size in enumerate(x.shape)]
        mask = torch.zeros(shape, dtype=torch.bool, device=x.device)
        for location, (position, head) in enumerate(self.chunk):
            index = [slice(None)] * x.dim()
            if batch is not None:
                index[batch] = slice(location * self.rows, (location + 1) * self.rows)
            if position is not None:
                index[self.axes["positions"]] = position
            if head is not None:
                index[self.axes["heads"]] = head
            mask[tuple(index)] = True
        return torch.where(mask, source.to(x.dtype), x)


def _plan(program):
    """The program cut at every block boundary (once per built program)."""
    plan = _PLANS.get(program)
    if plan is None:
        blocks = len(program.family.block_mixers(program.model.config))
        plan = _PLANS[program] = split(program.module, blocks_of(program.family), list(range(1, blocks)))
    return plan


def spots_of(dims: list[str], shape, positions, heads, name: str, layout: str) -> tuple[dict, dict, list]:
    """``(axes, chosen, spots)`` of a patch at ``name`` (laid out as ``dims``, sized ``shape``): the axes of
    its positions and heads, the indices asked along each (``[None]``: the whole axis), and every
    ``(position, head)`` location in order."""
    axes = {what: axis_of(dims, what) for what in ("positions", "heads")}
    chosen = {}
    for what, given in (("positions", positions), ("heads", heads)):
        if given is not None and axes[what] is None:
            raise InvalidArgument(f"patch({what}={given!r}) at '{name}': its layout ({layout}) has no "
                                  f"{'/'.join(AXES[what])} axis; leave {what}=None to patch the whole value")
        chosen[what] = [None] if given is None else locations(given, shape[axes[what]], what, name)
    return axes, chosen, [(p, h) for p in chosen["positions"] for h in chosen["heads"]]


def stacked(values: list, chosen: dict, positions, heads, name: str):
    """``patch``'s result of one value from each location's metric: the metric itself for the whole value,
    else a tensor ``[positions]``, ``[heads]`` or ``[positions, heads]``."""
    if positions is None and heads is None:
        return values[0]
    shape = [len(chosen[what]) for what, given in (("positions", positions), ("heads", heads)) if given is not None]
    return torch.tensor([_scalar(value, name) for value in values]).reshape(shape)


def axis_of(dims: list[str], what: str) -> int | None:
    """The axis of a layout's ``dims`` that ``what`` (an edit selector: batch, positions, heads) addresses."""
    return next((dims.index(name) for name in AXES[what] if name in dims), None)


def locations(given, size: int, what: str, name: str) -> list[int]:
    """``"each"`` (every index of the axis) or indices, checked and made non-negative."""
    if isinstance(given, str):
        if given != "each":
            raise InvalidArgument(f"patch({what}={given!r}): give None (the whole value), \"each\" or a list of "
                                  "indices")
        return list(range(size))
    chosen = indices(given, what, f"patch({what}=...) at '{name}'")
    bad = [i for i in chosen if not -size <= i < size]
    if bad:
        raise InvalidArgument(f"patch({what}={chosen}) at '{name}': {bad} out of range for an axis of size {size}")
    return [i % size for i in chosen]


def _scalar(value, name: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise InvalidType(f"patch with positions= or heads= stacks metric values into a tensor: metric(logits) must "
                      f"return a number or a one-element tensor, got {type(value).__name__}"
                      f"{tuple(value.shape) if isinstance(value, torch.Tensor) else ''} at '{name}'")
