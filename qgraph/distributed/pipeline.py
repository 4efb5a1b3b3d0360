"""Run a program's stages (``split.Plan``): all in this process, or one per torchrun rank.

In one process the stages run in turn, autograd through all of them; with ``devices`` each runs on
its device (``place``). With ``microbatches=M`` the batch is cut into ``M`` parts (``tensor_split``:
3 rows into 2 and 1) that run one after another, and the outputs are joined along the batch.

Under torchrun (``torch.distributed`` initialised, or ``WORLD_SIZE`` set: ``world.join``) rank ``r``
runs stage ``r`` (stages ``r``, ``r + W``, ... with an interleaved schedule) and holds only the
parameters those stages read; every rank is called with the same inputs and edits (as torchrun runs
one script on every rank). The stages run on torch's own engine (``engine``:
``torch.distributed.pipelining``, its ``PipelineStage`` and schedules), forward alone or, with a
``loss``, forward and backward, so gradients cross processes. Each rank returns the program outputs
its stages computed; ``gather`` sends them to rank 0 (with the gradients of the values asked with
``{"grad": True}`` and the loss) as point-to-point messages: a header (kind, dtype, shape), then the
payload.

qgraph had its own point-to-point protocol for the stages before (forward only, under no_grad);
measured against it on the 0.8B shape, torch's engine runs the forward as fast (0.98x with one
micro-batch, 0.94x with two: ``benchmarks/bench_stages.py``), so it is the one engine.
"""
from __future__ import annotations

import torch

from ..compat import pipelining_refusal
from ..errors import InvalidArgument, InvalidState, InvalidType, NotSupported
from ..runners import loss_value
from .engine import Engine, stage_device
from .place import Placement
from .split import Plan, pick
from .world import World, pipe, vote

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.int8, torch.uint8, torch.int16]
_HEADER = 10  # kind, dtype, ndim, then up to 7 sizes
_SCALARS = {int: (1, torch.int64), float: (2, torch.float64), bool: (3, torch.bool)}


def _tag(position: int, base: int) -> int:
    """The tag of a gathered message (its header; the payload's is the next)."""
    return base + position * 2


class Pipeline:
    """Runs a ``Plan`` on program arguments; ``batched`` says which program inputs are cut into
    micro-batches (along dim 0), and every program output is joined along dim 0. ``kinds`` names each
    program input (``(kind, name)``, kind "parameter", "buffer", "constant" or "input"), ``values`` are
    the program's placeholder values (their symbolic shapes), ``logits`` the position of the logits among
    the outputs (None without), ``devices`` one device per stage (in one process; ``recorded`` is the
    device the graph names)."""

    def __init__(self, plan: Plan, world: World | None, batched: set[int], microbatches: int = 1,
                 gather: bool = False, schedule: str = "gpipe", *, kinds: list, values: list,
                 logits: int | None = None, devices=None, recorded: torch.device, timeout: float = 60.0):
        self.plan, self.world, self.batched, self.microbatches = plan, world, batched, microbatches
        self.gathering, self.logits, self.schedule = gather, logits, schedule
        self.placement = Placement(plan, devices, kinds, recorded) if devices is not None else None
        self.engine: Engine | None = None  # the stages across processes (torchrun), with a world
        if world is not None:
            refusal = pipelining_refusal()
            if refusal is not None:
                raise NotSupported(f"stages across processes (torchrun) run on torch.distributed.pipelining, and "
                                   f"{refusal}: upgrade torch, or instrument without torch.distributed initialised "
                                   f"to run every stage in this process")
            if schedule.startswith("interleaved") and len(plan) % world.size:
                raise InvalidArgument(f"stages={len(plan)} with schedule='{schedule}' runs the same number of stages "
                                      f"in each of the {world.size} processes: make the stages a multiple of "
                                      f"{world.size}")
            if not schedule.startswith("interleaved") and world.size != len(plan):
                raise InvalidArgument(f"stages={len(plan)} runs one stage per process, but this torch.distributed "
                                      f"world has {world.size}: launch with torchrun --nproc_per_node {len(plan)} (or "
                                      f"instrument without torch.distributed initialised to run every stage in this "
                                      f"process)")
            parameters = {i for i, (kind, _) in enumerate(kinds) if kind == "parameter"}
            differentiable = parameters | {i for i, (kind, _) in enumerate(kinds) if kind == "input"
                                           and isinstance(values[i], torch.Tensor) and values[i].is_floating_point()}
            self.engine = Engine(plan, world.rank, world.size, batched, values, differentiable, parameters, schedule,
                                 logits, timeout)

    def abandon(self, error: Exception) -> None:
        """This rank failed before its stages ran (its arguments): under torchrun, tell the other ranks at
        the vote that starts a call, so that every rank raises (this one ``error``)."""
        if self.engine is not None:
            vote(error, self.engine.timeout, start=True)

    def local_inputs(self, count: int) -> list[int]:
        """The program inputs (of ``count``) this process's stages read (all of them in one process)."""
        if self.engine is None:
            return list(range(count))
        return sorted({where[0] for stage in self.engine.local for kind, *where in self.plan.inputs[stage]
                       if kind == "input"})

    def __call__(self, args: list, loss=None, watched=frozenset()) -> tuple[list, torch.Tensor | None]:
        """(the program outputs, the loss's value or None). With ``loss`` (a function of the logits to
        a scalar) the backward runs too: per micro-batch, summed; ``watched`` output positions keep
        their gradients (``.grad``): in this process with micro-batches each is the tuple of its
        micro-batches' tensors (the ones later stages read), so that ``Output.grad`` joins their
        gradients after the loss's backward or the caller's own."""
        if self.placement is not None:
            self.placement.check(args)
        if self.engine is not None:  # the caller's own backward cannot cross processes: loss= does
            joined, value = self.engine(args, self.microbatches, loss, watched if loss is not None else frozenset())
            if not self.gathering:
                return joined, value
            failure = None
            try:
                gathered = self.gather(joined, watched if loss is not None else frozenset(), value, loss is not None)
            except Exception as error:  # noqa: BLE001 - every rank raises it (or names it) after the vote
                failure = error
            vote(failure, self.engine.timeout)
            return gathered
        count = min(self.microbatches, *(args[i].shape[0] for i in self.batched)) if self.batched else 1
        parts = [[arg.tensor_split(count)[m] if i in self.batched else arg for i, arg in enumerate(args)]
                 for m in range(count)]
        at = None  # the logits' position among the outputs, for the loss
        if loss is not None:
            if self.logits is None:
                raise InvalidState("loss= reads the logits, which this program does not compute")
            at = self.logits
        results: list[list] = [[] for _ in self.plan.outputs]
        value = None
        for margs in parts:
            outputs = self._local(margs)
            for position, output in enumerate(outputs):
                results[position].append(output)
            if at is not None:
                part = loss_value(loss, outputs[at])
                value = part if value is None else value + part
        if value is not None:
            for position in watched:
                for piece in results[position]:
                    if piece.requires_grad:
                        piece.retain_grad()
            value.backward()
            value = value.detach()
        joined = [None if pieces[0] is None else pieces[0] if len(pieces) == 1 else torch.cat(pieces)
                  for pieces in results]
        if count > 1:  # a watched value's readers read its pieces, not their join: its gradient is theirs, joined
            for position in watched:  # (output.Output.grad; a backward of the loss or the caller's own)
                joined[position] = tuple(results[position])
        return joined, value

    def _local(self, args: list) -> list:
        """Every stage in this process, in order (each on its device, with ``devices``)."""
        produced: list = []
        place = self.placement
        for index, module in enumerate(self.plan.modules):
            if place is None:
                inputs = [args[where[0]] if kind == "input" else pick(produced[where[0]], where[1])
                          for kind, *where in self.plan.inputs[index]]
            else:
                inputs = [place.argument(index, where[0], args[where[0]]) if kind == "input" else
                          place.crossing(index, pick(produced[where[0]], where[1]))
                          for kind, *where in self.plan.inputs[index]]
            produced.append(module(*inputs))
        return [args[where[0]] if kind == "input" else pick(produced[where[0]], where[1])
                for kind, *where in self.plan.outputs]

    def gather(self, outputs: list, watched=frozenset(), value=None, backward: bool = False) \
            -> tuple[list, torch.Tensor | None]:
        """Every program output on rank 0 (sent by the rank that owns it), the gradients of the ``watched``
        ones and the loss's ``value`` with them; other ranks keep their own."""
        if self.world is None or self.engine is None:
            return outputs, value
        rank, sends, group = self.world.rank, [], pipe(self.engine.timeout)
        gathered = list(outputs)
        for position in range(len(outputs)):
            owner = self.plan.owner(position)
            if owner is None or owner % self.world.size == 0:
                continue
            if rank == owner % self.world.size:
                sends += _isend(outputs[position], 0, _tag(position, 1 << 24), group)
                if position in watched:
                    grad = outputs[position].grad
                    sends += _isend(False if grad is None else grad, 0, _tag(position, 2 << 24), group)
            elif rank == 0:
                gathered[position] = _recv(owner % self.world.size, _tag(position, 1 << 24), group)
                if position in watched:
                    grad = _recv(owner % self.world.size, _tag(position, 2 << 24), group)
                    gathered[position].requires_grad_(True)
                    gathered[position].grad = grad if isinstance(grad, torch.Tensor) else None
        last = (len(self.plan) - 1) % self.world.size
        if backward and last != 0:  # the loss, from the last stage's rank
            if rank == last:
                sends += _isend(value, 0, _tag(0, 3 << 24), group)
            elif rank == 0:
                value = _recv(last, _tag(0, 3 << 24), group)
        for work in sends:
            work.wait()
        return gathered, value


def _isend(value, dst: int, tag: int, group) -> list:
    """Send ``value`` (a tensor or a Python scalar) to rank ``dst``: its header, then its payload."""
    import torch.distributed as dist
    if isinstance(value, torch.Tensor):
        kind, payload = 0, value.contiguous()
    elif type(value) in _SCALARS:
        kind, dtype = _SCALARS[type(value)]
        payload = torch.tensor(value, dtype=dtype)
    else:
        raise InvalidType(f"a stage sends {type(value).__name__}, which qgraph cannot send between processes")
    if payload.dim() > _HEADER - 3:
        raise InvalidArgument(f"a stage sends a {payload.dim()}-dim tensor; qgraph sends at most {_HEADER - 3} dims")
    header = torch.full((_HEADER,), -1, dtype=torch.int64)
    header[:3] = torch.tensor([kind, _DTYPES.index(payload.dtype), payload.dim()])
    header[3:3 + payload.dim()] = torch.tensor(payload.shape, dtype=torch.int64)
    device = payload.device
    return [dist.isend(header.to(device), dst, group=group, tag=tag),
            dist.isend(payload, dst, group=group, tag=tag + 1)]


def _recv(src: int, tag: int, group):
    import torch.distributed as dist
    device = stage_device()
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group, tag=tag)
    kind, dtype, ndim, *shape = header.tolist()
    payload = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)
    dist.recv(payload, src, group=group, tag=tag + 1)
    return payload if kind == 0 else payload.item()


