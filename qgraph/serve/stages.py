"""``torchrun --nproc_per_node G -m qgraph serve MODEL --stages G``: one model past one process.

Every rank loads the model and instruments it with ``Stages(G, gather=True)`` (each rank runs its stage on
torch's pipelining; rank 0 gets every value). Rank 0 serves HTTP; before each forward its batcher sends
the bodies of the requests it runs to the other ranks (lengths, then bytes, over a gloo group of its
own), which check them as rank 0 did and run the same calls in step. The bodies are the clients' own
bytes, parsed on every rank by ``wire.parse``: nothing is unpickled. When rank 0 stops (SIGTERM) it
sends the other ranks an empty round, and they exit.
"""
from __future__ import annotations

from datetime import timedelta

import torch

from .limits import Limits
from .request import request_of
from .wire import Bounds, parse
from ..distributed import Stages
from ..errors import UsageError
from .run import Runner

STOP = -1
IDLE = timedelta(days=365)  # the other ranks wait this long for the next request


def _send(bodies: list[bytes] | None, group) -> None:
    import torch.distributed as dist
    count = torch.tensor([STOP if bodies is None else len(bodies)])
    dist.broadcast(count, 0, group=group)
    if bodies:
        dist.broadcast(torch.tensor([len(body) for body in bodies]), 0, group=group)
        dist.broadcast(torch.frombuffer(bytearray(b"".join(bodies)), dtype=torch.uint8), 0, group=group)


def _receive(group) -> list[bytes] | None:
    import torch.distributed as dist
    count = torch.tensor([0])
    dist.broadcast(count, 0, group=group)
    if count.item() == STOP:
        return None
    lengths = torch.zeros(int(count.item()), dtype=torch.long)
    dist.broadcast(lengths, 0, group=group)
    data = torch.zeros(int(lengths.sum()), dtype=torch.uint8)
    dist.broadcast(data, 0, group=group)
    raw, bodies, start = data.numpy().tobytes(), [], 0
    for length in lengths.tolist():
        bodies.append(raw[start:start + length])
        start += length
    return bodies


class Leader:
    """Rank 0's runner: each round's bodies to the other ranks, then the round itself."""

    def __init__(self, runner, group):
        self.runner, self.group = runner, group

    @property
    def forwards(self) -> int:
        return self.runner.forwards

    def info(self) -> dict:
        return self.runner.info()

    def check(self, request) -> None:
        self.runner.check(request)  # on rank 0 alone: a request it refuses is never sent to the others

    def run(self, requests: list) -> list:
        _send([request.body for request in requests], self.group)
        return self.runner.run(requests)

    def close(self) -> None:
        try:
            _send(None, self.group)
        except Exception:  # noqa: BLE001 — a rank already gone (torchrun signalled it too)
            pass


def follow(runner, group, limits: Limits) -> None:
    """Another rank: run each round rank 0 sends, until it sends the stop."""
    while True:
        bodies = _receive(group)
        if bodies is None:
            return
        runner.run([request_of(*parse(body, Bounds()), limits) for body in bodies])


def serve_stages(args, keys, load, limits: Limits) -> int:
    """``qgraph serve --stages N`` under torchrun (N processes); ``load()`` -> ``(path, model)``."""
    import os

    import torch.distributed as dist

    from .server import serve  # lazy: keeps starlette out until this is used
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size != args.stages:
        raise UsageError(f"--stages {args.stages} runs one stage per process: start it under "
                         f"'torchrun --nproc_per_node {args.stages} -m qgraph serve ... --stages {args.stages}' "
                         f"(this is {size} process{'es' if size != 1 else ''})")
    if not dist.is_initialized():
        dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    group = dist.new_group(backend="gloo", timeout=IDLE)
    path, model = load()
    runner = Runner(model, name=str(path), stages=Stages(args.stages, gather=True), limits=limits)
    try:
        if dist.get_rank() != 0:
            follow(runner, group, limits)
            return 0
        leader = Leader(runner, group)
        try:
            return serve(leader, limits, keys, args.host, args.port)
        finally:
            leader.close()
    finally:
        dist.destroy_process_group()
