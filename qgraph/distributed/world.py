"""Ranks under torchrun: this process's rank, the world's size, and waiting for the others.

When ``torch.distributed`` is initialised, qgraph uses it as it is. Otherwise, under torchrun
(``WORLD_SIZE`` > 1 in the environment) it initialises the default group itself, ``nccl`` when the
model is on a GPU and ``gloo`` on CPU (and capture destroys it at the end). Capture splits rows by
rank (rank ``r`` of ``w`` takes rows ``r, r + w, ...``); stages run one per rank (``pipeline``).

A failure on one rank of a staged call ends every rank with its error (``vote``). The stages' messages
cross a group of qgraph's own (``pipe``), whose every wait is bounded by ``Stages(timeout=)``; a
control group (gloo) holds a vote at the start of each call (a rank that failed before its stage ran
says so; the ranks may come at different times, so a rank waits there as long as torch's default
timeout) and at its end (each rank's failure or None; a rank waits at most twice the timeout there).
Where a rank catches its failure in qgraph's own code (the loss, a stage's forward: ``engine``) it
still sends what the others wait for, so that every rank comes to the vote at once; elsewhere (in
torch's schedule, a backward) the ranks waiting on its messages raise when the timeout runs out, and
come to the vote then. The default group is the caller's: qgraph changes neither it nor its timeout.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from ..errors import InvalidState

if TYPE_CHECKING:  # a type only: torch.distributed is imported where a rank needs it
    from torch.distributed import ProcessGroup


@dataclass
class World:
    rank: int = 0
    size: int = 1
    owned: bool = False  # whether capture initialised the group (and so destroys it)

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        if self.owned and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def join(device: torch.device) -> World:
    """This process's rank and the world size, initialising the group under torchrun if needed."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if not dist.is_available():
        raise InvalidState("WORLD_SIZE > 1 but this torch has no torch.distributed")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    return World(dist.get_rank(), dist.get_world_size(), owned=True)


# -- one failure ends every rank -------------------------------------------------------------------
@dataclass
class _Groups:
    world: ProcessGroup | None  # the default group these were made in (a new one makes new ones)
    control: ProcessGroup  # gloo, torch's default timeout: the votes at the start and the end of a call
    # the stages' messages: the default group's backend, every wait bounded by the timeout
    pipe: ProcessGroup | None = None


_GROUPS: dict[float, _Groups] = {}  # timeout -> the groups qgraph made for stages with that timeout


def _groups(timeout: float) -> _Groups:
    import torch.distributed as dist
    held = _GROUPS.get(timeout)
    if held is None or held.world is not dist.group.WORLD:  # every rank comes here at the same call: made together
        held = _GROUPS[timeout] = _Groups(dist.group.WORLD, dist.new_group(backend="gloo"))
    return held


def pipe(timeout: float):
    """The group the stages' messages cross: a wait on it longer than ``timeout`` seconds raises. Made
    after a vote at the start of a call (``vote``), so the ranks are together while it connects."""
    import torch.distributed as dist
    held = _groups(timeout)
    if held.pipe is None:
        held.pipe = dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=timeout))
    return held.pipe


def vote(failure: BaseException | None, timeout: float, *, start: bool = False) -> None:
    """Every rank calls this at the same point of a call with its failure or None; when any rank
    brings one, every rank raises: a rank its own error, the others ``InvalidState`` naming the first
    rank that failed and its error (an error a rank only got from another's failure, a message that
    timed out or a connection closed, is not its own). At the end of a call (``start`` false) a rank
    waits at most twice ``timeout`` for the others: one may be waiting on a message for ``timeout``."""
    import torch.distributed as dist
    held = _groups(timeout)
    flag = torch.tensor([0 if failure is None else 1])
    work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=held.control, async_op=True)
    try:
        work.wait() if start else work.wait(timedelta(seconds=2 * timeout))
    except RuntimeError as error:
        _GROUPS.pop(timeout, None)  # a vote left pending: these groups are not used again
        raise InvalidState(f"rank {dist.get_rank()} waited {2 * timeout:g} s at the end of a staged call for a rank "
                           f"that did not come: it is stuck or gone (its stderr says which); if a stage takes longer "
                           f"than that on one micro-batch, give Stages(timeout=) more seconds") from (failure or error)
    if not flag.item():
        return
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, _report(failure), group=held.control)
    if held.pipe is not None:  # a failure may leave messages in it: the next call makes a new one, on every rank
        dist.destroy_process_group(held.pipe)
        held.pipe = None
    own = [rank for rank, report in enumerate(reports) if report is not None and report[0]]
    if failure is not None and dist.get_rank() in own:  # a rank that reports its own failure holds it
        raise failure
    origin = own[0] if own else next(rank for rank, report in enumerate(reports) if report is not None)
    kind, text = reports[origin][1:]
    raise InvalidState(f"rank {origin} failed in a staged call ({kind}: {text}); every rank stops with its error: "
                       f"see rank {origin}'s traceback, fix what it names and call again on every rank") from failure


def _report(failure: BaseException | None):
    """What a rank tells the others of its failure: (whether it is its own, its type's name, its message)."""
    if failure is None:
        return None
    # gloo reports a peer's closed connection or a message that timed out as a RuntimeError naming its transport
    passed_on = isinstance(failure, torch.distributed.DistError) or "gloo/transport" in str(failure)
    while type(failure) is RuntimeError and failure.__cause__ is not None:  # torch's schedule wraps what a stage
        failure = failure.__cause__  # raised ("failed to run forward", "Failed to run stage backward"): its cause
    return (not passed_on, type(failure).__name__, str(failure).strip()[:4000])
