"""Run a program's stages (``split.Plan``) one per process, or all in this one.

Under torchrun (``torch.distributed`` initialised, or ``WORLD_SIZE`` set: ``world.join``) rank ``r``
runs stage ``r`` and holds only the parameters that stage reads. Every rank is called with the same
inputs and edits (as torchrun runs one script on every rank). A stage receives what it reads from
earlier stages (point-to-point ``recv``), runs, and sends each output to the later stages that read
it (``isend``, so it goes on with the next micro-batch while they work): with ``microbatches=M`` the
batch is cut into ``M`` parts that flow through the stages one after another, which keeps every
stage busy once the pipeline is full. Each rank returns the program outputs its stage computed;
``gather`` sends them to rank 0.

A message is a header (kind, dtype, shape) and the payload; sizes between stages that the graph
computes (a ``sym_size``) travel as scalars. Gradients do not cross processes: a stage across
processes runs under ``torch.no_grad()`` (in one process, autograd runs through every stage).
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgument, InvalidType
from .split import Plan, pick
from .world import World

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.int8, torch.uint8, torch.int16]
_HEADER = 10  # kind, dtype, ndim, then up to 7 sizes
_SCALARS = {int: (1, torch.int64), float: (2, torch.float64), bool: (3, torch.bool)}


def _tag(microbatch: int, output: int, part: int, base: int = 0) -> int:
    return base + (microbatch * 4096 + output) * 2 + part


class Pipeline:
    """Runs a ``Plan`` on program arguments; ``batched`` says which program inputs are cut into
    micro-batches (along dim 0), and every program output is joined along dim 0."""

    def __init__(self, plan: Plan, world: World | None, batched: set[int], microbatches: int = 1,
                 gather: bool = False):
        self.plan, self.world, self.batched, self.microbatches = plan, world, batched, microbatches
        self.gathering = gather
        if world is not None and world.size != len(plan):
            raise InvalidArgument(f"stages={len(plan)} runs one stage per process, but this torch.distributed world has "
                             f"{world.size}: launch with torchrun --nproc_per_node {len(plan)} (or instrument without "
                                  f"torch.distributed initialised to run every stage in this process)")

    def local_inputs(self, count: int) -> list[int]:
        """The program inputs (of ``count``) this process's stage reads (all of them in one process)."""
        if self.world is None:
            return list(range(count))
        return [where[0] for kind, *where in self.plan.inputs[self.world.rank] if kind == "input"]

    def __call__(self, args: list) -> list:
        count = min(self.microbatches, *(args[i].shape[0] for i in self.batched)) if self.batched else 1
        parts = [[arg.tensor_split(count)[m] if i in self.batched else arg for i, arg in enumerate(args)]
                 for m in range(count)]
        results = [[] for _ in self.plan.outputs]
        sends = []
        for m, margs in enumerate(parts):
            outputs = self._local(margs) if self.world is None else self._stage(m, margs, sends)
            for position, value in enumerate(outputs):
                results[position].append(value)
        for work in sends:
            work.wait()
        joined = [None if pieces[0] is None else pieces[0] if len(pieces) == 1 else torch.cat(pieces)
                  for pieces in results]
        return self.gather(joined) if self.gathering else joined

    def _local(self, args: list) -> list:
        """Every stage in this process, in order."""
        produced = []
        for index, module in enumerate(self.plan.modules):
            inputs = [args[where[0]] if kind == "input" else pick(produced[where[0]], where[1])
                      for kind, *where in self.plan.inputs[index]]
            produced.append(module(*inputs))
        return [args[where[0]] if kind == "input" else pick(produced[where[0]], where[1])
                for kind, *where in self.plan.outputs]

    def _stage(self, m: int, args: list, sends: list) -> list:
        """This rank's stage on micro-batch ``m``: receive, run, send; the outputs it owns (None for others')."""
        rank = self.world.rank
        inputs = [args[where[0]] if kind == "input" else _recv(where[0], _tag(m, where[1] or 0, 0))
                  for kind, *where in self.plan.inputs[rank]]
        with torch.no_grad():
            produced = self.plan.modules[rank](*inputs)
        for output, readers in enumerate(self.plan.readers[rank]):
            for reader in readers:
                sends += _isend(pick(produced, output if isinstance(produced, (tuple, list)) else None), reader,
                                _tag(m, output, 0))
        return [args[where[0]] if kind == "input" else pick(produced, where[1]) if where[0] == rank else None
                for kind, *where in self.plan.outputs]

    def gather(self, outputs: list) -> list:
        """Every program output on rank 0 (sent by the rank that owns it); other ranks keep their own."""
        if self.world is None:
            return outputs
        rank, sends = self.world.rank, []
        gathered = list(outputs)
        for position in range(len(outputs)):
            owner = self.plan.owner(position)
            if owner is None or owner == 0:
                continue
            if rank == owner:
                sends += _isend(outputs[position], 0, _tag(0, position, 0, base=1 << 24))
            elif rank == 0:
                gathered[position] = _recv(owner, _tag(0, position, 0, base=1 << 24))
        for work in sends:
            work.wait()
        return gathered


def _isend(value, dst: int, tag: int) -> list:
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
    return [dist.isend(header.to(device), dst, tag=tag), dist.isend(payload, dst, tag=tag + 1)]


def _recv(src: int, tag: int):
    import torch.distributed as dist
    device = _device()
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, tag=tag)
    kind, dtype, ndim, *shape = header.tolist()
    payload = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)
    dist.recv(payload, src, tag=tag + 1)
    return payload if kind == 0 else payload.item()


def _device() -> torch.device:
    """Where this rank's messages land: its GPU under nccl, else the CPU."""
    import torch.distributed as dist
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

